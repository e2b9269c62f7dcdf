"""Prompt prefill of a random-weight target (GPU script): what a request pays before its first token, the first
time the process meets its prompt length and again.

A server sees a new prompt length with nearly every request, so a cost paid once per length (a kernel compiled or
planned for the shape) lands on a user's time to first token. For each length, in the order given: the first
prefill at that length in this process ("first"), then the median of `--repeats` more ("again"), each the wall
time of `ModelRunner.prefill` (the engine's prefill: chunks, final norm, logits of the last token) from a reset
cache to a synchronised device, after one prefill of `--warmup-length` tokens has paid the process's start-up
costs (CUDA context, cuBLAS handles). `--profile N` adds a torch.profiler table of the first prefill of N tokens
(N must not be among the lengths timed before it), to name what a first-time cost is.

    python -m benchmarks.bench_prefill [--target smollm2-135m] [--lengths 30 31 47 100 333 1000] [--profile 517]
        [--out prefill.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from benchmarks.fp8_targets import TARGETS, random_target
from dflash_tfm.config import ModelConfig
from dflash_tfm.engine.model_runner import ModelRunner
from dflash_tfm.models.presets import SMOLLM2_135M

SHAPES = {"smollm2-135m": SMOLLM2_135M, **{name: target for name, (target, _) in TARGETS.items()}}


def prefill_seconds(runner: ModelRunner, length: int) -> float:
    """Wall seconds of one prefill of `length` random tokens from an empty cache, synchronised."""
    ids = torch.randint(0, runner.model.config.vocab_size, (length,))
    runner.reset()
    torch.cuda.synchronize()
    start = time.perf_counter()
    runner.prefill(ids)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def profile_table(runner: ModelRunner, length: int) -> str:
    """The profiler's top operators (self CPU time) of the first prefill of `length` tokens."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        prefill_seconds(runner, length)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m", choices=sorted(SHAPES), help="the shapes of the target")
    ap.add_argument("--lengths", type=int, nargs="+", default=[30, 31, 47, 100, 333, 1000])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup-length", type=int, default=8)
    ap.add_argument("--profile", type=int, default=None, metavar="N", help="profile the first prefill of N tokens")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = ModelConfig.from_dict(SHAPES[args.target])
    max_len = max([*args.lengths, args.profile or 0, args.warmup_length]) + 1
    runner = ModelRunner(random_target(cfg, torch.device("cuda"), torch.bfloat16, max_len), max_len,
                         torch.device("cuda"))
    prefill_seconds(runner, args.warmup_length)
    rows = []
    for length in args.lengths:
        first = prefill_seconds(runner, length)
        again = statistics.median(prefill_seconds(runner, length) for _ in range(args.repeats))
        rows.append({"length": length, "first_ms": 1e3 * first, "again_ms": 1e3 * again})
    print(f"\n{args.target} on {torch.cuda.get_device_name()}: prefill wall ms (first at a length, then median of "
          f"{args.repeats})")
    print("| prompt tokens | first | again |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['length']} | {r['first_ms']:.1f} | {r['again_ms']:.1f} |")
    report = {"gpu": torch.cuda.get_device_name(), "target": args.target, "rows": rows}
    if args.profile is not None:
        report["profile"] = profile_table(runner, args.profile)
        print(f"\nfirst prefill of {args.profile} tokens:\n{report['profile']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
