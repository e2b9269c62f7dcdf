"""Time proposal-tree building (step 2 of a decode step) at Qwen3.6-27B shapes on one GPU (a script, not a test).

DDTREE (best-first over the DFlash marginals) and the Weaver tree (published Weaver shape: d_model 5120,
d_rank 2048, 16 heads, mlp 2048, 1 block, K 15, pool 512, variant 1; random weights) over a 248320-token
vocabulary, eager and captured in a CUDA graph. The Weaver time covers the whole step-2 work: top-512 candidate
pools, the 16-row prefix encode and every batched expansion round. The target only contributes its embedding and
lm_head, so a light stand-in with random [248320, 5120] bf16 tensors replaces the 27B model.
Prints a markdown table of median milliseconds (CUDA events, after warm-up).

    python benchmarks/bench_tree_build.py [--budgets 16 64 128] [--children-per-node 16 8] [--reps 50] [--profile]

--profile also prints the kernels of one Weaver build at the largest budget (eager; the graph replays the same kernels).
"""
from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch

from benchmarks.kernel_profile import print_kernel_table
from benchmarks.timing import capture, report_choices, time_ms
from dflash_tfm.config import ModelConfig
from dflash_tfm.models.presets import PUBLISHED_WEAVER
from dflash_tfm.spec.chain import build_chain
from dflash_tfm.spec.ddtree import build_ddtree
from dflash_tfm.spec.weaver import load_weaver
from dflash_tfm.spec.weaver_fixtures import write_random_weaver_checkpoint
from dflash_tfm.spec.weaver_tree import ROUND_IMPLEMENTATIONS, build_weaver_tree, round_width

VOCAB, HIDDEN, BLOCK = 248320, 5120, 16
K = BLOCK - 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument("--children-per-node", type=int, nargs="+", default=[16, 8],
                        help="Weaver children published per expanded node (16 = our default, 8 = published)")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--variant", type=int, default=1, choices=(1, 2, 3))
    parser.add_argument("--profile", action="store_true", help="kernel table of a Weaver build")
    args = parser.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)

    target = SimpleNamespace(
        embed_tokens=torch.randn(VOCAB, HIDDEN, device=device, dtype=dtype) * 0.02,
        lm_head_weight=torch.randn(VOCAB, HIDDEN, device=device, dtype=dtype) / HIDDEN**0.5,
    )
    target_cfg = ModelConfig.from_dict(dict(model_type="llama", vocab_size=VOCAB, hidden_size=HIDDEN,
                                            intermediate_size=17408, num_hidden_layers=1, num_attention_heads=40))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "weaver.pth"
        write_random_weaver_checkpoint(path, target_cfg, K=K, **(PUBLISHED_WEAVER | {"variant": args.variant}))
        weaver = load_weaver(path, target, target_cfg, BLOCK, device, dtype)

    root = torch.tensor(1234, device=device)
    logits = torch.randn(K, VOCAB, device=device) * 4.0  # peaked enough for deep best-first trees
    h_dflash = torch.randn(K, HIDDEN, device=device, dtype=dtype)
    h_target = torch.randn(HIDDEN, device=device, dtype=dtype)

    builders: list[tuple[str, int, int, Callable[[], object]]] = [("chain", K, 0, lambda: build_chain(root, logits))]
    for budget in args.budgets:
        builders.append(("ddtree", budget, 0, lambda b=budget: build_ddtree(root, logits, b)))
        for children in args.children_per_node:
            for impl in ROUND_IMPLEMENTATIONS:
                builders.append((f"weaver ({impl})", budget, children, lambda b=budget, c=children, i=impl:
                                 build_weaver_tree(weaver, root, logits, h_dflash, h_target, b,
                                                   children_per_node=c, implementation=i)))

    print(f"tree build on {torch.cuda.get_device_name()}, vocab {VOCAB}, K {K}, Weaver variant {args.variant} "
          f"(d_rank 2048, 16 heads, mlp 2048, 1 block, pool 512), bf16 Weaver, fp32 logits; median of {args.reps}\n")
    print("| builder | budget | children per node | Weaver rounds × width | eager ms | CUDA graph ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, budget, children, fn in builders:
        eager = time_ms(fn, args.reps, warmup=5)
        try:
            replay = f"{time_ms(capture(fn, warmups=3)[0].replay, args.reps, warmup=5):.3f}"
        except RuntimeError as e:  # report, and keep timing the other builders
            replay = f"capture failed: {str(e).splitlines()[0][:60]}"
        width = round_width(budget, children) if children else 0
        rounds = f"{-(-budget // width)} × {width}" if children else "—"
        print(f"| {name} | {budget} | {children or '—'} | {rounds} | {eager:.3f} | {replay} |")
    report_choices({})  # the row tiles the triton_fused builds took
    if args.profile:
        budget = max(args.budgets)
        print()
        for impl in ROUND_IMPLEMENTATIONS:
            print_kernel_table(lambda i=impl: build_weaver_tree(weaver, root, logits, h_dflash, h_target, budget,
                                                                implementation=i),
                               f"Weaver tree build, budget {budget}, default width, {impl}")


if __name__ == "__main__":
    main()
