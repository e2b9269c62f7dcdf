"""Target verify step (one forward over a proposal tree) of a random-weight target vs its autoregressive decode
step (GPU script): Qwen3.6-27B-shaped by default, or Qwen3.5-35B-A3B-shaped (`--target qwen3.5-35b-a3b`), where a
tree of N tokens reads the union of their experts and verify(N) / AR grows much faster with N.

For N = 1, 16, 65, 129 tree nodes (best-first shaped trees, depth <= 15) below a 1k-token context, the
verify forward + logits and the commit of a depth-5 path are each captured in a CUDA graph and timed with
CUDA events after warm-up (median). The AR step is the engine's captured decode step at the same context.

    python benchmarks/bench_verify_step.py --out $OUT/verify_step.json [--kernel chunk|recurrent]
        [--target qwen3.6-27b|qwen3.5-35b-a3b] [--ns 1 4 8 16 32 65]
"""
from __future__ import annotations

import argparse
import json

import torch

from benchmarks.fp8_targets import TARGETS, random_target
from benchmarks.timing import capture, report_choices, time_ms
from dflash_tfm.config import ModelConfig
from dflash_tfm.engine.model_runner import ModelRunner
from dflash_tfm.layers.linear import skinny_projections
from dflash_tfm.tree import TreeSpec, random_parents


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ns", type=int, nargs="+", default=[1, 16, 65, 129])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--kernel", default="chunk", choices=["chunk", "recurrent"])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--quantization", default=None, choices=["fp8"], help="hold the projections in FP8")
    ap.add_argument("--target", default="qwen3.6-27b", choices=sorted(TARGETS), help="the shapes of the target")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = ModelConfig.from_dict(TARGETS[args.target][0])
    device = torch.device("cuda")
    model = random_target(cfg, device, torch.bfloat16, args.context + 1024, args.quantization)
    L = args.context
    settings = {"target": args.target, "context": L, "kernel": args.kernel, "quantization": args.quantization}
    results = settings | time_steps(model, cfg, args, device)
    print(f"\n| N | verify ms | / AR step | commit ms |  (AR step {results['ar_step_ms']:.2f} ms, {args.target}, "
          f"context {L}, GDN kernel {args.kernel})")
    print("|---|---|---|---|")
    for n, r in results["verify"].items():
        print(f"| {n} | {r['verify_ms']:.2f} | {r['verify_ms'] / results['ar_step_ms']:.2f}x | {r['commit_ms']:.3f} |")
    report_choices(results)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
