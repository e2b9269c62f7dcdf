"""Where the time of one target step goes (GPU script): kernels per step and CUDA time per kernel name, from
torch.profiler over eager steps of the Qwen3.6-27B-shaped random-weight target — the autoregressive decode
step, or with --verify-nodes N the verify forward over an N-node best-first tree plus its commit.

    python benchmarks/profile_decode_step.py [--layers 64] [--top 25] [--verify-nodes 65] [--context 1024]
"""
from __future__ import annotations

import argparse
from typing import Callable

import torch

from benchmarks.bench_verify_step import first_child_path
from benchmarks.kernel_profile import print_kernel_table
from dflash_tfm.config import ModelConfig
from dflash_tfm.engine.model_runner import ModelRunner
from dflash_tfm.layers.linear import skinny_projections
from dflash_tfm.loading.loader import build_model
from dflash_tfm.models.presets import QWEN3_6_27B
from dflash_tfm.models.random_init import init_random_
from dflash_tfm.tree import TreeSpec, random_parents


def verify_and_commit(model, runner: ModelRunner, nodes: int, context: int) -> Callable[[], None]:
    """One verify (+ logits) and the commit of a depth-5 path, on a tree below a `context`-token prefix. Every
    call commits the same path at the same length again (the states drift; the kernels and shapes do not)."""
    device = runner.device
    runner.prefill(torch.randint(0, model.config.vocab_size, (context,), device=device))
    parents = random_parents(nodes, "best_first", seed=nodes, max_depth=15).to(device)
    tokens = torch.randint(0, model.config.vocab_size, (nodes,), device=device)
    length = torch.tensor([context], device=device)
    tree = TreeSpec.build(tokens.view(1, -1), parents.view(1, -1), cache_len=length)
    accepted, path_idx = first_child_path(parents)

    def step() -> None:
        hidden, _, saved = model.verify(tree, runner.cache, length)
        model.logits(hidden[0]).argmax(-1)
        model.commit(runner.cache, length, tree, saved, accepted, path_idx)

    return step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--verify-nodes", type=int, default=0, help="profile verify + commit of this many nodes")
    ap.add_argument("--context", type=int, default=1024, help="tokens in the cache before the profiled steps")
    args = ap.parse_args()
    cfg = ModelConfig.from_dict({**QWEN3_6_27B, "num_hidden_layers": args.layers})
    max_len = args.context + 1024
    model = init_random_(build_model(cfg, torch.device("cuda"), torch.bfloat16, max_positions=max_len + 1024))
    runner = ModelRunner(model, max_len=max_len, device=torch.device("cuda"), use_cuda_graph=False)
    if args.verify_nodes:
        with torch.inference_mode():
            step = verify_and_commit(model, runner, args.verify_nodes, args.context)
    else:
        with torch.inference_mode():
            runner.prefill(torch.randint(0, cfg.vocab_size, (args.context,), device="cuda"))
        token = torch.tensor([11], device="cuda")
        positions = iter(range(args.context, 10**6))

        def step() -> None:
            runner.decode(token, next(positions))
    with torch.inference_mode(), skinny_projections():  # (the decode step enters it itself too)
        for _ in range(3):  # compile + warm up
            step()
        what = f"verify + commit of {args.verify_nodes} nodes" if args.verify_nodes else "decode step"
        print_kernel_table(step, f"{args.layers} layers, {what}", args.steps, args.top)


if __name__ == "__main__":
    main()
