"""Time the tree-verification kernels at Qwen3.6-27B shapes on one GPU (a script, not a test).

GDN: ``gdn_tree_verify`` chunk (row blocks 16/32) vs the recurrent baseline (state snapshot per node) at
N = 16, 32, 65, 129 best-first tree tokens, and the fold commit. Each measurement is one CUDA graph holding the
call for all 48 GDN layers, each layer with its own 3 MiB fp32 state (more than L2), so the time has the
state traffic of a real verify step and no launch overhead; reported as the median µs per layer. The
ancestor bitsets are built once per step outside the timed region, as the engine does. Also: tree attention
(24 q / 4 kv heads, head_dim 256, cache 4096, 16 attention layers) and the tree conv (C = 10240) at N = 65.
Prints markdown tables; the KERNELS.md target is ≤ 45 µs per GDN layer at N = 65.

    python benchmarks/bench_tree_kernels.py [--ns 16 32 65 129] [--gdn-layers 48]
"""
from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from dflash_tfm.kernels import gdn_tree_commit, gdn_tree_verify, tree_attention, tree_causal_conv1d, tree_conv_commit
from dflash_tfm.kernels.gdn.tree_reference import gdn_tree_verify_reference
from dflash_tfm.spec.tree import ancestor_bitsets, random_parents

HK, HV, DK, DV = 16, 48, 128, 128            # GDN layer
H, HKV, HEAD_DIM, CACHE = 24, 4, 256, 4096   # gated attention layer
CONV_CHANNELS = 2 * HK * DK + HV * DV         # conv over q|k|v


def time_graph(fn: Callable[[int], object], layers: int) -> float:
    """Median µs per call of ``fn(layer)``, all ``layers`` calls captured in one CUDA graph."""
    fn(0)  # compile / warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(layers):
            fn(layer)
    return do_bench(graph.replay, warmup=25, rep=200, return_mode="median") * 1e3 / layers


def tree(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Best-first tree of n nodes: parents [1, n], bitsets, and the accepted mask of its deepest path."""
    parents = random_parents(n, "best_first")[None].cuda()
    bits = ancestor_bitsets(parents)
    accepted = torch.zeros(1, n, dtype=torch.bool, device="cuda")
    node = n - 1
    while node >= 0:
        accepted[0, node] = True
        node = int(parents[0, node])
    return parents, bits, accepted


def gdn_inputs(n: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(n)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda")

    return {
        "q": F.normalize(randn(1, n, HK, DK), dim=-1).bfloat16(),
        "k": F.normalize(randn(1, n, HK, DK), dim=-1).bfloat16(),
        "v": randn(1, n, HV, DV).bfloat16(),
        "g": F.logsigmoid(randn(1, n, HV) + 2.0),
        "beta": torch.rand(1, n, HV, generator=gen, device="cuda"),
    }


def bench_gdn(ns: list[int], layers: int) -> None:
    states = [0.5 * torch.randn(1, HV, DK, DV, device="cuda") for _ in range(layers)]
    print(f"\n### GDN tree verify, µs per layer (B=1, HK={HK}, HV={HV}, dk=dv={DK}, bf16 in, fp32 state, "
          f"{layers} layers per graph)\n")
    print("| N | chunk b16 | chunk b32 | recurrent | speedup | fold commit | chunk b16 eager | max rel err |")
    print("|---|---|---|---|---|---|---|---|")
    for n in ns:
        x = gdn_inputs(n)
        parents, bits, accepted = tree(n)

        def verify(layer: int, kernel: str = "chunk", block: int = 16):
            return gdn_tree_verify(**x, parents=parents, initial_state=states[layer], kernel=kernel,
                                   ancestors=bits, block_size=block)

        chunk = {b: time_graph(lambda layer, b=b: verify(layer, block=b), layers) for b in (16, 32)}
        recurrent = time_graph(lambda layer: verify(layer, "recurrent"), layers)
        contexts = [verify(layer)[1] for layer in range(layers)]
        commit = time_graph(lambda layer: gdn_tree_commit(contexts[layer], accepted), layers)
        eager = do_bench(lambda: verify(0), return_mode="median") * 1e3
        o_ref, _ = gdn_tree_verify_reference(**x, parents=parents, initial_state=states[0])
        err = max(((verify(0, kernel, b)[0].float() - o_ref.float()).abs().max() / o_ref.float().abs().max()).item()
                  for kernel, b in (("chunk", 16), ("chunk", 32), ("recurrent", 16)))
        print(f"| {n} | {chunk[16]:.1f} | {chunk[32]:.1f} | {recurrent:.1f} | "
              f"{recurrent / min(chunk.values()):.2f}x | {commit:.1f} | {eager:.1f} | {err:.1e} |")


def bench_attention_and_conv(n: int, attn_layers: int, conv_layers: int) -> None:
    parents, bits, accepted = tree(n)
    q = torch.randn(1, n, H, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k_tree, v_tree = (torch.randn(1, n, HKV, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    caches = [tuple(torch.randn(1, CACHE, HKV, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
              for _ in range(attn_layers)]
    attn = time_graph(lambda layer: tree_attention(q, *caches[layer], CACHE - 96, k_tree, v_tree, bits), attn_layers)
    x = torch.randn(1, n, CONV_CHANNELS, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(CONV_CHANNELS, 4, device="cuda", dtype=torch.bfloat16)
    windows = [torch.randn(1, CONV_CHANNELS, 3, device="cuda", dtype=torch.bfloat16) for _ in range(conv_layers)]
    conv = time_graph(lambda layer: tree_causal_conv1d(x, weight, parents, windows[layer]), conv_layers)
    conv_commit = time_graph(lambda layer: tree_conv_commit(x, parents, accepted, windows[layer]), conv_layers)
    print(f"\n### Attention and conv at N = {n}, µs per layer\n")
    print("| kernel | shape | µs |")
    print("|---|---|---|")
    print(f"| tree_attention | {H} q / {HKV} kv heads, d {HEAD_DIM}, cache {CACHE - 96} | {attn:.1f} |")
    print(f"| tree_causal_conv1d | C {CONV_CHANNELS}, width 4, SiLU | {conv:.1f} |")
    print(f"| tree_conv_commit | C {CONV_CHANNELS} | {conv_commit:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ns", type=int, nargs="+", default=[16, 32, 65, 129], help="tree sizes for GDN")
    parser.add_argument("--gdn-layers", type=int, default=48)
    parser.add_argument("--attn-layers", type=int, default=16)
    parser.add_argument("--attn-n", type=int, default=65)
    args = parser.parse_args()
    print(f"device: {torch.cuda.get_device_name()}")
    bench_gdn(args.ns, args.gdn_layers)
    bench_attention_and_conv(args.attn_n, args.attn_layers, args.gdn_layers)


if __name__ == "__main__":
    main()
