"""Target verify step (one forward over a proposal tree) of the Qwen3.6-27B-shaped random-weight target vs
its autoregressive decode step (GPU script).

For N = 1, 16, 65, 129 tree nodes (best-first shaped trees, depth <= 15) below a 1k-token context, the
verify forward + logits and the commit of a depth-5 path are each captured in a CUDA graph and timed with
CUDA events after warm-up (median). The AR step is the engine's captured decode step at the same context.
With several ``--prefetch`` settings (MiB of L2 prefetch in mixer and short windows, optionally followed by
their `l2_prefetch` layouts; layers/weight_prefetch.py), AR and verify are timed once per setting, each with
its own graphs. ``--prefetch-from`` takes the settings from `bench_l2_prefetch --out`'s best per window:
none, each window's best alone, and both.

    python benchmarks/bench_verify_step.py --out $OUT/verify_step.json [--kernel chunk|recurrent]
        [--prefetch 0:0 32:0 32:8 32:8:strided:prefix | --prefetch-from l2_prefetch.json]
"""
from __future__ import annotations

import argparse
import json

import torch

from benchmarks.timing import capture, report_choices, time_ms
from dflash_tfm.config import ModelConfig
from dflash_tfm.engine.model_runner import ModelRunner
from dflash_tfm.layers.attention import decode_attention_choice, verify_attention_choice
from dflash_tfm.layers.gated_deltanet import gdn_verify_path_choice
from dflash_tfm.layers.linear import projection_choice, skinny_projections
from dflash_tfm.layers.norm import add_norm_rows_choice
from dflash_tfm.layers.weight_prefetch import WINDOWS, prefetch_bytes, prefetch_layouts, prefetching
from dflash_tfm.loading.loader import build_model
from dflash_tfm.models.presets import QWEN3_6_27B
from dflash_tfm.models.random_init import init_random_
from dflash_tfm.spec.tree import TreeSpec, random_parents


def first_child_path(parents: torch.Tensor, depth: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """A path to commit: from the root, the first child down to `depth` (or a leaf), as the commit takes it —
    accepted [1, N] bool and path indices [1, 16], -1 padded."""
    path = [0]
    while len(path) <= depth and (parents == path[-1]).any():
        path.append(int((parents == path[-1]).nonzero()[0]))
    accepted = torch.zeros(1, parents.shape[-1], dtype=torch.bool, device=parents.device)
    accepted[0, path] = True
    path_idx = torch.full((1, 16), -1, dtype=torch.long, device=parents.device)
    path_idx[0, : len(path)] = torch.tensor(path, device=parents.device)
    return accepted, path_idx


def time_steps(model, cfg: ModelConfig, args: argparse.Namespace, device: torch.device) -> dict:
    """A fresh runner (its own AR graph): the AR step, then each N's verify and commit, all at the context."""
    runner = ModelRunner(model, max_len=args.context + 512, device=device)
    runner.reset()
    L = args.context
    runner.prefill(torch.randint(0, cfg.vocab_size, (L,), device=device))
    token = torch.tensor([7], device=device)
    runner.decode(token, L)  # capture the AR graph (it writes slot L, which verify never reads)
    ar_ms = time_ms(lambda: runner.decode(token, L), args.iters)
    print(f"AR decode step at context {L}: {ar_ms:.2f} ms", flush=True)
    results = {"ar_step_ms": ar_ms, "verify": {}}
    with torch.inference_mode(), skinny_projections():  # as the engine's speculative step runs it
        for n in args.ns:
            parents = random_parents(n, "best_first", seed=n, max_depth=15).to(device)
            tokens = torch.randint(0, cfg.vocab_size, (n,), device=device)
            tree = TreeSpec.build(tokens.view(1, -1), parents.view(1, -1), cache_len=L)
            saved = []  # the captured pass's commit context

            def verify():
                hidden, _, context = model.verify(tree, runner.cache, L, gdn_kernel=args.kernel)
                saved[:] = [context]
                return model.logits(hidden[0])

            graph, _ = capture(verify)
            verify_ms = time_ms(graph.replay, args.iters)
            depth = tree.depths[0]
            accepted, path_idx = first_child_path(parents)
            snapshot = [(s.clone(), w.clone()) for s, w in runner.cache.gdn.values()]
            cgraph, _ = capture(lambda: model.commit(runner.cache, L, tree, saved[0], accepted, path_idx))
            commit_ms = time_ms(cgraph.replay, args.iters)
            for (s, w), (s0, w0) in zip(runner.cache.gdn.values(), snapshot):
                s.copy_(s0)
                w.copy_(w0)
            results["verify"][n] = {"verify_ms": verify_ms, "commit_ms": commit_ms, "max_depth": int(depth.max())}
            print(f"N={n}: verify {verify_ms:.2f} ms ({verify_ms / ar_ms:.2f}x AR), commit {commit_ms:.3f} ms", flush=True)
            del graph, cgraph
    return results


def prefetch_setting(setting: str) -> dict:
    """"MIXER:SHORT" MiB, or "MIXER:SHORT:MIXER_LAYOUT:SHORT_LAYOUT" -> `prefetching` keyword arguments."""
    parts = setting.split(":")
    if len(parts) not in (2, 4):
        raise SystemExit(f"--prefetch {setting!r}: expected MIXER:SHORT or MIXER:SHORT:MIXER_LAYOUT:SHORT_LAYOUT")
    sizes = {window: int(mib) << 20 for window, mib in zip(WINDOWS, parts[:2])}
    return sizes | {f"{window}_layout": layout for window, layout in zip(WINDOWS, parts[2:])}


def settings_from(path: str) -> list[str]:
    """`--prefetch` settings from `bench_l2_prefetch --out`: no prefetch, each window's best setting alone (where
    one beat no prefetch there), and both together."""
    with open(path) as f:
        found = json.load(f)
    best = {window: found[window]["best"] for window in WINDOWS}

    def setting(windows: list[str]) -> str:
        mib = [str(best[w]["mib"]) if w in windows else "0" for w in WINDOWS]
        layouts = [best[w]["layout"] if w in windows else "prefix" for w in WINDOWS]
        return ":".join(mib + layouts)

    alone = [setting([w]) for w in WINDOWS if best[w]]
    return ["0:0"] + alone + ([setting(list(WINDOWS))] if len(alone) == len(WINDOWS) else [])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ns", type=int, nargs="+", default=[1, 16, 65, 129])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--kernel", default="chunk", choices=["chunk", "recurrent"])
    ap.add_argument("--iters", type=int, default=50)
    current = [str(prefetch_bytes()[w] >> 20) for w in WINDOWS] + [prefetch_layouts()[w] for w in WINDOWS]
    ap.add_argument("--prefetch", nargs="+", default=[":".join(current)],
                    help="MIXER:SHORT MiB of L2 prefetch per window kind, optionally :MIXER_LAYOUT:SHORT_LAYOUT "
                         "(layers/weight_prefetch.py; default: the current settings); one run each")
    ap.add_argument("--prefetch-from", default=None,
                    help="JSON of bench_l2_prefetch --out: run no prefetch, each window's best, and both instead")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = ModelConfig.from_dict(QWEN3_6_27B)
    device = torch.device("cuda")
    model = init_random_(build_model(cfg, device, torch.bfloat16, max_positions=args.context + 1024))
    L = args.context
    results = {"context": L, "kernel": args.kernel, "runs": {}}
    for setting in settings_from(args.prefetch_from) if args.prefetch_from else args.prefetch:
        with prefetching(**prefetch_setting(setting)):  # captured into this run's graphs
            results["runs"][setting] = run = time_steps(model, cfg, args, device)
        torch.cuda.empty_cache()  # the finished run's runner, caches and graphs
        print(f"\n| N | verify ms | / AR step | commit ms |  (AR step {run['ar_step_ms']:.2f} ms, context {L}, GDN "
              f"kernel {args.kernel}, L2 prefetch MiB mixer:short {setting})")
        print("|---|---|---|---|")
        for n, r in run["verify"].items():
            print(f"| {n} | {r['verify_ms']:.2f} | {r['verify_ms'] / run['ar_step_ms']:.2f}x | {r['commit_ms']:.3f} |")
    report_choices(results, projections=projection_choice, decode_attention=decode_attention_choice,
                   verify_attention=verify_attention_choice, gdn_verify_path=gdn_verify_path_choice,
                   add_norm_rows=add_norm_rows_choice)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
