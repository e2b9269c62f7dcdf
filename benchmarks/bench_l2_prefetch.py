"""Does warming L2 with the start of the next weight during the GDN tree solve speed up that GEMM? (GPU
script, not a test.)

The solve leaves HBM nearly idle for ~30 µs per layer; the GEMM after it (out_proj: rows × 6144 → 5120,
63 MB of bf16 weight, more than L2 holds) streams its weight cold. Over 48 layers, each with its own weight
and state, one CUDA graph per variant, median µs per layer: the solve, the GEMM, the two in sequence, and
`l2_prefetch` of the first P MB (or the same share of every row) launched just before the solve.

    python -m benchmarks.bench_l2_prefetch [--rows 65] [--mib 8 16 24 32 40]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.bench_tree_kernels import DK, DV, HV, gdn_inputs, tree
from benchmarks.timing import time_graph
from dflash_tfm.kernels import gdn_tree_verify
from dflash_tfm.kernels.linear.l2_prefetch import l2_prefetch

LAYERS, HIDDEN, VALUE_DIM = 48, 5120, 6144


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=65, help="GEMM rows and tree nodes")
    ap.add_argument("--mib", type=int, nargs="+", default=[8, 16, 24, 32, 40, 48])
    args = ap.parse_args()
    torch.manual_seed(0)
    weights = [torch.randn(HIDDEN, VALUE_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
    x = torch.randn(args.rows, VALUE_DIM, device="cuda", dtype=torch.bfloat16)
    parents, bits, _ = tree(args.rows)
    inputs = gdn_inputs(args.rows)
    states = [torch.randn(1, HV, DK, DV, device="cuda") * 0.1 for _ in range(LAYERS)]
    props = torch.cuda.get_device_properties(0)

    def gdn(layer: int) -> None:
        i = inputs
        gdn_tree_verify(i["q"], i["k"], i["v"], i["g"], i["beta"], parents, states[layer], ancestors=bits)

    def gemm(layer: int) -> None:
        F.linear(x, weights[layer])

    def show(name: str, us: float) -> None:
        print(f"| {name} | {us:.2f} |", flush=True)

    print(f"rows {args.rows}, L2 {props.L2_cache_size / 2**20:.0f} MiB, weight "
          f"{weights[0].numel() * 2 / 2**20:.0f} MiB\n| variant | µs per layer |\n|---|---|")
    show("gdn", time_graph(gdn, LAYERS))
    show("gemm", time_graph(gemm, LAYERS))
    show("gdn; gemm", time_graph(lambda l: (gdn(l), gemm(l)), LAYERS))
    show("prefetch 0 (launch only); gdn; gemm", time_graph(lambda l: (l2_prefetch(weights[l], 16), gdn(l), gemm(l)),
                                                           LAYERS))
    for mib in args.mib:
        for spread in (False, True):
            def step(layer: int, n: int = mib << 20, s: bool = spread) -> None:
                l2_prefetch(weights[layer], n, spread_rows=s)
                gdn(layer)
                gemm(layer)
            show(f"prefetch {mib} MiB{' spread over rows' if spread else ''}; gdn; gemm", time_graph(step, LAYERS))
    side = torch.cuda.Stream()
    for mib in args.mib[1::2]:
        def forked(layer: int, n: int = mib << 20) -> None:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                l2_prefetch(weights[layer], n)
            gdn(layer)
            torch.cuda.current_stream().wait_stream(side)
            gemm(layer)
        show(f"prefetch {mib} MiB on a side stream || gdn; gemm", time_graph(forked, LAYERS))


if __name__ == "__main__":
    main()
