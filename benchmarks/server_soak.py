"""Soak a running server: N requests in a row (chat, completions and /generate in turn, some streamed, some
abandoned mid-stream) and the server process's resident memory before, during and after.

    python -m dflash_tfm.launch_server --device cpu --port 30000 &
    python -m benchmarks.server_soak --base-url http://127.0.0.1:30000 --pid $! --requests 200

Memory is read from /proc/PID/status (VmRSS), so run it on the server's machine (Linux).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import httpx


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def one_request(client: httpx.Client, i: int, model: str) -> None:
    kind = i % 4
    if kind == 0:
        client.post("/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": f"Say {i}."}],
                                                  "max_tokens": 8, "temperature": 0}).raise_for_status()
    elif kind == 1:
        client.post("/v1/completions", json={"model": model, "prompt": f"Count to {i}:", "max_tokens": 8,
                                             "temperature": 0.8, "seed": i}).raise_for_status()
    elif kind == 2:
        with client.stream("POST", "/generate", json={"text": f"Item {i}:", "stream": True,
                                                      "sampling_params": {"max_new_tokens": 8}}) as r:
            r.raise_for_status()
            for _ in r.iter_lines():
                pass
    else:  # abandoned after the first event: the server must free the slot
        with client.stream("POST", "/v1/completions", json={"model": model, "prompt": "Once upon a time",
                                                            "max_tokens": 64, "stream": True}) as r:
            r.raise_for_status()
            next(line for line in r.iter_lines() if line.startswith("data: "))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", required=True)
    p.add_argument("--pid", type=int, required=True, help="the server process, for its memory")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--api-key", default=None)
    args = p.parse_args()
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(base_url=args.base_url, headers=headers, timeout=120.0) as client:
        model = client.get("/v1/models").raise_for_status().json()["data"][0]["id"]
        one_request(client, 0, model)  # warm-up
        start, samples, t0 = rss_mib(args.pid), [], time.perf_counter()
        for i in range(args.requests):
            one_request(client, i, model)
            if (i + 1) % max(1, args.requests // 10) == 0:
                samples.append(rss_mib(args.pid))
        elapsed = time.perf_counter() - t0
    print(f"{args.requests} requests in {elapsed:.1f} s; server RSS MiB: after warm-up {start:.0f}, "
          f"every {max(1, args.requests // 10)} requests {' '.join(f'{m:.0f}' for m in samples)}; "
          f"growth {samples[-1] - start:+.0f} MiB")


if __name__ == "__main__":
    main()
