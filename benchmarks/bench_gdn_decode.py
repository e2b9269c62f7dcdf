"""Time the GDN decode kernel at Qwen3.6-27B shapes on one GPU (a script, not a test).

One CUDA graph holds one decode step for each of the 48 GDN layers, each layer with its own 3 MiB fp32
state (144 MiB in all, far more than L2), so the time includes the state traffic of a real decode step and
no launch overhead. Reports the median µs per layer call and the bandwidth achieved on the state bytes
(read + write) for each (block_v, num_warps) config, next to a same-size device copy as the ceiling.

    python benchmarks/bench_gdn_decode.py [--batch 1] [--tokens 1] [--layers 48]
"""
from __future__ import annotations

import argparse
import itertools

import torch
from triton.testing import do_bench

from benchmarks.timing import time_graph

from dflash_tfm.kernels.gdn.decode import gdn_decode
from dflash_tfm.kernels.gdn.reference import make_gdn_inputs

HK, HV, DK, DV = 16, 48, 128, 128  # Qwen3.6-27B GDN layer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=1, help="decode tokens per call (T)")
    parser.add_argument("--layers", type=int, default=48, help="distinct states per graph (GDN layers)")
    args = parser.parse_args()

    x = make_gdn_inputs(args.batch, args.tokens, HK, HV, DK, DV, dtype=torch.bfloat16, device="cuda")
    q, k, v, g, beta = (x[name] for name in ("q", "k", "v", "g", "beta"))
    states = [x["initial_state"].clone() for _ in range(args.layers)]
    out = torch.empty_like(v)
    state_bytes = 2 * states[0].numel() * states[0].element_size()  # read + write per call

    def gbps(us: float) -> float:
        return state_bytes / (us * 1e-6) / 1e9

    copies = [torch.empty_like(s) for s in states]
    copy_us = time_graph(lambda layer: copies[layer].copy_(states[layer]), args.layers)
    print(f"GDN decode B={args.batch} T={args.tokens} HK={HK} HV={HV} dk={DK} dv={DV}, "
          f"{state_bytes / 2**20:.1f} MiB state traffic per call, {args.layers} layers per graph")
    print(f"device copy of one state (ceiling): {copy_us:8.2f} us  {gbps(copy_us):7.0f} GB/s")

    results = []
    for block_v, num_warps in itertools.product((8, 16, 32, 64), (1, 2, 4, 8)):
        def step(layer: int, block_v: int = block_v, num_warps: int = num_warps) -> None:
            gdn_decode(q, k, v, g, beta, states[layer], out=out, block_v=block_v, num_warps=num_warps)

        us = time_graph(step, args.layers)
        results.append((us, block_v, num_warps))
        print(f"block_v={block_v:3d} num_warps={num_warps}: {us:8.2f} us  {gbps(us):7.0f} GB/s")

    default_us = time_graph(lambda layer: gdn_decode(q, k, v, g, beta, states[layer], out=out), args.layers)
    eager_us = do_bench(lambda: gdn_decode(q, k, v, g, beta, states[0], out=out), return_mode="median") * 1e3
    best_us, best_bv, best_nw = min(results)
    print(f"default config: {default_us:8.2f} us  {gbps(default_us):7.0f} GB/s   (eager, no graph: {eager_us:.2f} us)")
    print(f"best: block_v={best_bv} num_warps={best_nw}  {best_us:.2f} us  {gbps(best_us):.0f} GB/s")


if __name__ == "__main__":
    main()
