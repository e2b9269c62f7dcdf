"""Concurrent clients against one after another on a running server: the continuous-batching check
(8 concurrent greedy clients should finish in at most 0.6 x the one-after-another time).

    python -m dflash_tfm.launch_server --device cpu --dtype float32 --max-model-len 1024 --port 30000 &
    python -m benchmarks.server_concurrency --base-url http://127.0.0.1:30000 --clients 8 --max-tokens 32

Sends `--clients` greedy completions one after another, then all at once (one thread each), checks that every
client got the same text both ways, and prints both wall times and their ratio (concurrent / sequential; the
goal is <= 0.6 with 8 clients on a CPU). A warm-up request first, so neither timing pays for first-use
work.
"""
from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import httpx


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", required=True)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--api-key", default=None)
    args = p.parse_args()
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    prompts = [f"Question {i}: name {i + 2} animals that live in the sea." for i in range(args.clients)]
    with httpx.Client(base_url=args.base_url, headers=headers, timeout=600.0) as client:
        model = client.get("/v1/models").raise_for_status().json()["data"][0]["id"]

        def ask(prompt: str) -> str:
            body = {"model": model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
                    "ignore_eos": True}
            return client.post("/v1/completions", json=body).raise_for_status().json()["choices"][0]["text"]

        ask("Hello")  # warm-up
        t0 = time.perf_counter()
        sequential = [ask(prompt) for prompt in prompts]
        t_seq = time.perf_counter() - t0
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            concurrent = list(pool.map(ask, prompts))
        t_con = time.perf_counter() - t0
    if concurrent != sequential:
        raise SystemExit("concurrent clients got other texts than the same requests sent one after another")
    print(f"{args.clients} clients x {args.max_tokens} tokens: one after another {t_seq:.2f} s, "
          f"concurrent {t_con:.2f} s, ratio {t_con / t_seq:.2f}")


if __name__ == "__main__":
    main()
