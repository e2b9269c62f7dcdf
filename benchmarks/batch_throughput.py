"""Throughput and per-request latency of continuous batching, autoregressive against each speculative algorithm,
at several concurrencies (the serving check of batched speculative decoding).

For each algorithm (AR first) and each concurrency C, one `Engine` with `max_running_requests=C` (a speculative
one at `--budget`, a number or `auto`) decodes `--requests-per-slot` × C held-out demo prompts (chat template,
greedy, `--max-new-tokens` each, EOS ignored so every request does the same work). All requests arrive at once
and wait in a queue; a request enters the batch as soon as a slot frees, as in the server. Reported per cell:
total tokens per second of the whole run, per-request latency (arrival to last token) p50 / p99, per-request
decode speed (tokens / (last token − first token)) p50, and mean tokens per step; after a warm-up run of the
same requests, so the graphs, tuned choices and prompt shapes every cell uses are in place before it is timed
(a cost paid once per process, such as a new prompt shape, would otherwise land on whichever cell met it first:
AR, which runs first). Where a speculative cell makes AR's tokens per step, it did not speculate, and its
ratio to AR is the engines' overhead, not a speculation gain. Each request's tokens are compared with the AR cell's of
the same concurrency: how many requests are equal, and the mean share of each request's tokens before its first
difference. In fp32 every request is equal (greedy decoding is lossless); in bf16 a tree verify and a decode step
round differently, so a near-tie can flip a token and the two continuations part from there.

    python -m benchmarks.batch_throughput --concurrency 1 4 16 32 --algorithms AR DFLASH DDTREE DFLASH_TFM \\
        [--target-path SmolLM2.gguf] [--budget 16] [--dataset-dir DIR] [--out results.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import deque
from pathlib import Path

from tqdm import tqdm

from dflash_tfm import Engine, SamplingParams, SpeculativeConfig
from dflash_tfm.bench.datasets import prepare_dataset
from dflash_tfm.loading.default_model import DEFAULT_BUNDLE
from dflash_tfm.speculative_config import tree_budget_arg

SETS = ("mtbench", "humaneval", "gsm8k", "math500")


def prompts(count: int, dataset_dir: Path | None) -> list[str]:
    """`count` prompts, taken in turn from the four demo sets."""
    per_set = [prepare_dataset(name, limit=count, dataset_dir=dataset_dir).prompts for name in SETS]
    texts = [p.text for group in zip(*per_set) for p in group]
    return texts[:count]


def run(engine: Engine, texts: list[str], params: SamplingParams, concurrency: int) -> dict:
    """All of `texts` arrive now; the engine's batch takes them as slots free, at most `concurrency` running ->
    timings and tokens."""
    waiting = deque(enumerate(texts))
    arrived = time.perf_counter()
    first: dict[int, float] = {}
    done: dict[int, float] = {}
    tokens: dict[int, list[int]] = {i: [] for i in range(len(texts))}
    index = {}
    steps = 0
    while waiting or engine.batch.running:
        while waiting and engine.free_slots and engine.batch.running < concurrency:
            i, text = waiting.popleft()
            index[id(engine.add_request(text, params, chat=True))] = i
        for seq, delta in engine.step():
            i = index[id(seq)]
            if delta.token_ids and i not in first:
                first[i] = time.perf_counter()
            tokens[i] += delta.token_ids
            if delta.finish_reason is not None:
                done[i] = time.perf_counter()
        steps += 1
    wall = time.perf_counter() - arrived
    total = sum(len(t) for t in tokens.values())
    latency = sorted(done[i] - arrived for i in done)
    speed = sorted((len(tokens[i]) - 1) / (done[i] - first[i]) for i in done if done[i] > first[i])
    return {"wall_s": wall, "tokens": total, "tokens_per_s": total / wall, "steps": steps,
            "latency_p50_s": statistics.median(latency), "latency_p99_s": latency[min(len(latency) - 1,
                                                                                       int(0.99 * len(latency)))],
            "request_tok_s_p50": statistics.median(speed) if speed else 0.0, "outputs": tokens}


def agreement(outputs: dict[int, list[int]], reference: dict[int, list[int]]) -> tuple[str, float]:
    """("equal requests / requests", the mean share of a request's tokens before its first difference)."""
    equal, shares = 0, []
    for i, ref in reference.items():
        got = outputs[i]
        same = next((k for k, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
        equal += got == ref
        shares.append(same / max(len(ref), 1))
    return f"{equal}/{len(reference)}", sum(shares) / len(shares)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target-path", default=None, help="target checkpoint (default: the embedded SmolLM2)")
    p.add_argument("--bundle", type=Path, default=DEFAULT_BUNDLE, help="directory with dflash/ and weaver.pth")
    p.add_argument("--algorithms", nargs="+", default=["AR", "DFLASH", "DDTREE", "DFLASH_TFM"],
                   choices=["AR", "DFLASH", "DDTREE", "DFLASH_TFM"])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--budget", type=tree_budget_arg, default=16, help="tree budget of the speculative engines")
    p.add_argument("--requests-per-slot", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--dataset-dir", type=Path, default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if "AR" in args.algorithms:
        args.algorithms = ["AR"] + [a for a in args.algorithms if a != "AR"]
    params = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens, ignore_eos=True)
    texts = prompts(max(args.concurrency) * args.requests_per_slot, args.dataset_dir)
    rows, reference = [], {}
    for algorithm in args.algorithms:
        spec = None if algorithm == "AR" else SpeculativeConfig(
            algorithm, args.bundle / "dflash", args.bundle / "weaver.pth" if algorithm == "DFLASH_TFM" else None,
            tree_budget=args.budget)
        for c in tqdm(args.concurrency, desc=algorithm):
            engine = Engine(args.target_path, spec, device=args.device, dtype=args.dtype,
                            max_model_len=args.max_model_len, max_running_requests=max(c, 2), progress=False)
            batch_texts = texts[: c * args.requests_per_slot]
            run(engine, batch_texts, params, c)  # warm-up: the timed run's prompts, buckets, graphs and choices
            r = run(engine, batch_texts, params, c)
            outputs = r.pop("outputs")
            if algorithm == "AR":
                reference[c] = outputs
            if c in reference:
                r["equal_to_ar"], r["prefix_agreeing_with_ar"] = agreement(outputs, reference[c])
            rows.append({"algorithm": algorithm, "concurrency": c, **r})
            del engine
            if args.out:  # after every cell: a run cut short keeps what it measured
                args.out.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()},
                                                "rows": rows}, indent=1))
    print(f"\n{len(texts)} prompts max, {args.max_new_tokens} new tokens each, greedy, budget {args.budget}")
    print("| algorithm | concurrency | tokens/s | vs AR | latency p50 s | p99 s | request tok/s p50 | tokens/step "
          "| equal to AR | tokens before a difference |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    ar = {r["concurrency"]: r["tokens_per_s"] for r in rows if r["algorithm"] == "AR"}
    for r in rows:
        c = r["concurrency"]
        ratio = f"{r['tokens_per_s'] / ar[c]:.2f}x" if c in ar else "–"
        print(f"| {r['algorithm']} | {c} | {r['tokens_per_s']:.1f} | {ratio} | {r['latency_p50_s']:.2f} | "
              f"{r['latency_p99_s']:.2f} | {r['request_tok_s_p50']:.1f} | {r['tokens'] / r['steps']:.2f} | "
              f"{r.get('equal_to_ar', '–')} | {100 * r.get('prefix_agreeing_with_ar', float('nan')):.0f} % |")


if __name__ == "__main__":
    main()
