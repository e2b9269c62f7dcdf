"""Prompt prefill of a random-weight target (GPU script): what a request pays before its first token, the first
time the process meets its prompt length and again.

A server sees a new prompt length with nearly every request, so a cost paid once per shape (a kernel compiled or
planned for it) lands on a user's time to first token. The engine pads an attention-only target's chunks to a
multiple of 64 tokens on CUDA (`model_runner.prefill_padding`), so the shape is the padded width; `--pad-to 1`
prefills exact lengths, to compare. For each length, in the order given: the first prefill at that length in this
process ("first"), then the median of `--repeats` more ("again"), each the wall time of the engine's prefill
(`prefill_in_chunks`, then the logits of the last token) from a reset cache to a synchronised device, after one
prefill of `--warmup-length` tokens (a width no default length shares) has paid the process's start-up costs
(CUDA context, cuBLAS handles). The default lengths: 30 and 31 share a padded width, the others each have their
own. `--profile N` adds a torch.profiler table of the first prefill of N tokens (N in a width not timed before),
to name what a first-time cost is.

    python -m benchmarks.bench_prefill [--target smollm2-135m] [--lengths 30 31 100 333 1000] [--pad-to 1]
        [--profile 517] [--out prefill.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from benchmarks.fp8_targets import TARGETS, random_target
from dflash_tfm.config import ModelConfig
from dflash_tfm.engine.model_runner import PREFILL_PAD, ModelRunner, prefill_in_chunks
from dflash_tfm.models.presets import SMOLLM2_135M

SHAPES = {"smollm2-135m": SMOLLM2_135M, **{name: target for name, (target, _) in TARGETS.items()}}


@torch.inference_mode()
def prefill_seconds(runner: ModelRunner, length: int, pad_to: int | None) -> float:
    """Wall seconds of one prefill of `length` random tokens from an empty cache (chunks padded to `pad_to`, None:
    as the engine pads), synchronised."""
    ids = torch.randint(0, runner.model.config.vocab_size, (length,), device=runner.device)
    runner.reset()
    torch.cuda.synchronize()
    start = time.perf_counter()
    last = prefill_in_chunks(runner.model, ids, runner.cache, 0, runner.prefill_chunk, pad_to=pad_to)
    runner.model.logits(last)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def profile_table(runner: ModelRunner, length: int, pad_to: int | None) -> str:
    """The profiler's top operators (self CPU time) of the first prefill of `length` tokens."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        prefill_seconds(runner, length, pad_to)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m", choices=sorted(SHAPES), help="the shapes of the target")
    ap.add_argument("--lengths", type=int, nargs="+", default=[30, 31, 100, 333, 1000])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--pad-to", type=int, default=None,
                    help="pad chunks to a multiple of this (default: as the engine)")
    ap.add_argument("--warmup-length", type=int, default=1500)
    ap.add_argument("--profile", type=int, default=None, metavar="N", help="profile the first prefill of N tokens")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = ModelConfig.from_dict(SHAPES[args.target])
    max_len = max([*args.lengths, args.profile or 0, args.warmup_length]) + PREFILL_PAD  # room for padding
    runner = ModelRunner(random_target(cfg, torch.device("cuda"), torch.bfloat16, max_len), max_len,
                         torch.device("cuda"))
    prefill_seconds(runner, args.warmup_length, args.pad_to)
    rows = []
    for length in args.lengths:
        first = prefill_seconds(runner, length, args.pad_to)
        again = statistics.median(prefill_seconds(runner, length, args.pad_to) for _ in range(args.repeats))
        rows.append({"length": length, "first_ms": 1e3 * first, "again_ms": 1e3 * again})
    padding = "as the engine pads" if args.pad_to is None else f"padded to {args.pad_to}"
    print(f"\n{args.target} on {torch.cuda.get_device_name()}, {padding}: prefill wall ms (first at a length, then "
          f"median of {args.repeats})")
    print("| prompt tokens | first | again |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['length']} | {r['first_ms']:.1f} | {r['again_ms']:.1f} |")
    report = {"gpu": torch.cuda.get_device_name(), "target": args.target, "pad_to": args.pad_to, "rows": rows}
    if args.profile is not None:
        report["profile"] = profile_table(runner, args.profile, args.pad_to)
        print(f"\nfirst prefill of {args.profile} tokens:\n{report['profile']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
