"""The engine's whole speculative step at Qwen3.6-27B (or Qwen3.5-35B-A3B) scale, phase by phase (GPU script).

Target: the 27B-shaped random-BF16 model (`--target qwen3.5-35b-a3b`: the MoE one; `--quantization fp8`: its
projections in FP8); drafter: the published drafter of that target (27B: 1.73B parameters, 5 layers, block 16);
Weaver: the published shape (variant 1, d_rank 2048, 16 heads, mlp 2048, pool 512). All random, so almost
nothing is accepted: this measures time per step, not τ (tokens per step come from trained models; see
docs/TRAINING.md). For each algorithm, `SpeculativeDecoder.step` runs exactly as `Engine.generate` calls it
(each phase one CUDA-graph replay, one host read per step) after a 1024-token prefill; per-phase times come
from the decoder's own CUDA events, the whole step from the host clock. Medians over --steps steps after
warm-up, next to the AR decode step at the same context.

    python -m benchmarks.bench_spec_step --out $OUT/spec_step.json [--target …] [--quantization fp8] [--profile]

--profile also prints, per mode, the kernels of each phase of a few eager steps (the graphs replay the same kernels).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.fp8_targets import TARGETS, random_target
from benchmarks.kernel_profile import print_phase_tables
from benchmarks.timing import report_choices, time_ms
from dflash_tfm import tuning
from dflash_tfm.config import ModelConfig
from dflash_tfm.engine.decoder_factory import build_proposer
from dflash_tfm.engine.model_runner import ModelRunner
from dflash_tfm.engine.speculative import SpeculativeDecoder
from dflash_tfm.layers.linear import skinny_projections
from dflash_tfm.models.presets import PUBLISHED_WEAVER
from dflash_tfm.models.random_init import init_random_
from dflash_tfm.sampling_params import SamplingParams
from dflash_tfm.spec.dflash import DFlashDrafter
from dflash_tfm.spec import weaver_tree
from dflash_tfm.spec.dflash_config import DFlashConfig
from dflash_tfm.spec.weaver_fixtures import write_random_weaver_checkpoint
from dflash_tfm.speculative_config import SpeculativeConfig

PHASES = ("draft", "tree", "verify", "commit")


def measure(decoder: SpeculativeDecoder, prompt: list[int], params: SamplingParams, warmup: int, steps: int) -> dict:
    decoder.prefill(prompt, params, None)
    for _ in range(warmup):  # captures every phase's graph
        decoder.step(params, None)
    decoder.timer.collect_calls()
    walls, tokens = [], 0
    for _ in range(steps):  # as Engine.generate runs them: no synchronisation but each step's token read
        t0 = time.perf_counter()
        tokens += len(decoder.step(params, None))
        walls.append((time.perf_counter() - t0) * 1e3)
    calls = decoder.timer.collect_calls()  # draft: each step's draft runs at the end of the step before
    out = {p: 1e3 * statistics.median(calls[p]) for p in PHASES}
    out["step_ms"] = statistics.median(walls)
    out["tokens_per_step"] = tokens / steps
    # Each pure phase's graph replayed on its own (same inputs, so the same work), every replay from an idle
    # GPU: so these include the graph's launch latency, which inside the step is hidden behind the phase before
    # (the draft behind the previous commit): any excess over the in-step times is that latency.
    size = decoder.last_step_drafts
    keys = {"draft": ("draft", decoder.runner.bucket(decoder.length + decoder.max_depth)), "tree": ("tree", size),
            "verify": ("verify", size)}
    for phase, key in keys.items():
        if key in decoder.graphs:
            out[f"{phase}_alone"] = time_ms(lambda key=key: decoder.graphs.run(key, lambda: None), 20, warmup=3)
    return out


def profile_phases(decoder: SpeculativeDecoder, params: SamplingParams, name: str, steps: int = 3) -> list[int]:
    """Kernel tables of each phase of `steps` eager steps, called as `SpeculativeDecoder.step` calls them;
    returns the tokens those steps produced (the decode goes on from there)."""
    emitted: list[int] = []

    size = max(decoder.proposers)  # a fixed-budget decoder: its one size

    def commit() -> None:
        decoder._commit(params, size)
        emitted.extend(decoder._take_emitted())
    draft_len = lambda: decoder.runner.bucket(decoder.length + decoder.max_depth)  # noqa: E731
    with skinny_projections():
        print_phase_tables([("draft", lambda: decoder._draft(draft_len())), ("tree", lambda: decoder._tree(size)),
                            ("verify", lambda: decoder._verify(size)), ("commit", commit)], name, steps)
    return emitted


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--budgets", type=int, nargs="+", default=[64])
    ap.add_argument("--tfm-children-per-node", type=int, nargs="+", default=[16, 8],
                    help="DFLASH_TFM widths to time (16 = our default, 8 = published)")
    ap.add_argument("--tfm-round-units", type=int, nargs="+", default=[weaver_tree.ROUND_UNIT],
                    help="DFLASH_TFM rounds write ceil(budget / unit) nodes each (the engine's unit: "
                         f"{weaver_tree.ROUND_UNIT}); another unit times fewer, wider Weaver rounds")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--target", default="qwen3.6-27b", choices=sorted(TARGETS), help="the shapes of the target")
    ap.add_argument("--quantization", default=None, choices=["fp8"], help="hold the target's projections in FP8")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", action="store_true", help="kernel tables of each phase, per mode")
    args = ap.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    print(tuning.describe_kernel_path(device), flush=True)  # at start: the path a cache read gives this process
    target_raw, drafter_raw = TARGETS[args.target]
    cfg = ModelConfig.from_dict(target_raw)
    max_len = args.context + 2 * args.steps * 16 + 256
    model = random_target(cfg, device, dtype, max_len + 64, args.quantization)
    runner = ModelRunner(model, max_len=max_len, device=device)
    drafter = init_random_(DFlashDrafter(DFlashConfig.from_dict(drafter_raw), model, max_len=max_len + 64))
    block = drafter.config.block_size
    prompt = torch.randint(0, cfg.vocab_size, (args.context,)).tolist()
    greedy = SamplingParams(temperature=0.0)

    runner.reset()
    runner.prefill(torch.tensor(prompt))
    token = torch.tensor([7], device=device)
    runner.decode(token, args.context)
    ar_ms = time_ms(lambda: runner.decode(token, args.context), 50)
    print(f"AR decode step at context {args.context}: {ar_ms:.2f} ms", flush=True)

    results = {"target": args.target, "quantization": args.quantization, "context": args.context,
               "ar_step_ms": ar_ms, "modes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        weaver_path = Path(tmp) / "weaver.pth"
        write_random_weaver_checkpoint(weaver_path, cfg, K=block - 1, **PUBLISHED_WEAVER)
        modes = [("DFLASH", 1, 0, None)] + [("DDTREE", b, 0, None) for b in args.budgets]
        modes += [("DFLASH_TFM", b, c, u) for b in args.budgets for c in args.tfm_children_per_node
                  for u in args.tfm_round_units]
        engine_unit = weaver_tree.ROUND_UNIT
        for algo, budget, children, unit in modes:
            weaver_tree.ROUND_UNIT = unit or engine_unit  # read when the tree graph is captured
            spec = SpeculativeConfig(algo, weaver_path=weaver_path if algo == "DFLASH_TFM" else None,
                                     tree_budget=budget, **({"children_per_node": children} if children else {}))
            proposer = build_proposer(spec, runner, cfg, block)
            decoder = SpeculativeDecoder(runner, drafter, proposer)
            name = algo if algo == "DFLASH" else f"{algo} {budget}" + (f" c{children}" if children else "")
            name += f" u{unit}" if unit not in (None, engine_unit) else ""
            r = measure(decoder, prompt, greedy, args.warmup, args.steps)
            r["nodes"] = proposer.num_nodes
            results["modes"][name] = r
            print(name, {k: round(v, 3) for k, v in r.items()}, flush=True)
            if args.profile:
                profile_phases(decoder, greedy, name)
            del decoder
            torch.cuda.empty_cache()
        weaver_tree.ROUND_UNIT = engine_unit

    print(f"\n{torch.cuda.get_device_name()}, {args.target} {args.quantization or 'bf16'}, context {args.context}, "
          f"AR step {ar_ms:.2f} ms; median of {args.steps} steps")
    print("| mode | nodes | draft ms | tree ms | verify ms | commit ms | step ms (host) | (draft+tree+commit)/verify |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results["modes"].items():
        extra = (r["draft"] + r["tree"] + r["commit"]) / r["verify"]
        print(f"| {name} | {r['nodes']} | {r['draft']:.2f} | {r['tree']:.2f} | {r['verify']:.2f} | {r['commit']:.2f} "
              f"| {r['step_ms']:.2f} | {100 * extra:.0f}% |")
    print("\nEach pure phase's graph replayed alone from an idle GPU, launch latency included (ms): "
          "| mode | draft | tree | verify |")
    for name, r in results["modes"].items():
        print(f"| {name} | " + " | ".join(f"{r.get(p + '_alone', float('nan')):.2f}" for p in ("draft", "tree", "verify"))
              + " |")
    report_choices(results)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
