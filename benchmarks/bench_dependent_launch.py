"""Does programmatic dependent launch shorten a GDN layer's tree verify? (GPU script, not a test.)

At Qwen3.6-27B's GDN shapes and a best-first tree of N nodes, over 48 layers (each its own in/out projection
weights, 3 MiB state and conv window; one CUDA graph per variant), median µs per layer of
- "solve": the verify inputs kernel and the three tree-solve kernels (Gram, prep, substitution);
- "mixer": the same between the layer's in_proj and its gated norm + out_proj (cuBLAS GEMMs), as in verify;
each launched plainly and with PDL (``kernels/dependent_launch.py``), and whether both give the same bits.
``--ncu`` runs the mixer eagerly over 4 layers, both ways, and exits: a short program for Nsight Compute.

    python -m benchmarks.bench_dependent_launch [--ns 16 65 129] [--layers 48] [--ncu]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.bench_tree_kernels import CONV_CHANNELS, DK, DV, HK, HV, tree
from benchmarks.timing import time_graph
from dflash_tfm.kernels import gdn_tree_verify
from dflash_tfm.kernels.gdn.tree_inputs import gdn_tree_inputs
from dflash_tfm.layers.norm import gated_rms_norm

HIDDEN = 5120
PROJ = CONV_CHANNELS + HV * DV + 2 * HV


class Layers:
    """Random weights and state of `count` GDN layers, scaled like the random-weight target's."""

    def __init__(self, count: int) -> None:
        gen = torch.Generator(device="cuda").manual_seed(0)

        def randn(*shape: int, scale: float = 1.0, dtype=torch.bfloat16) -> torch.Tensor:
            return (scale * torch.randn(*shape, generator=gen, device="cuda")).to(dtype)

        self.in_w = [randn(PROJ, HIDDEN, scale=HIDDEN**-0.5) for _ in range(count)]
        self.out_w = [randn(HIDDEN, HV * DV, scale=(HV * DV) ** -0.5) for _ in range(count)]
        self.conv_w = [randn(CONV_CHANNELS, 4, scale=0.5) for _ in range(count)]
        self.windows = [randn(1, CONV_CHANNELS, 3) for _ in range(count)]
        self.states = [randn(1, HV, DK, DV, scale=0.5, dtype=torch.float32) for _ in range(count)]
        self.A_log = torch.empty(HV, device="cuda").uniform_(1.0, 16.0, generator=gen).log()
        self.dt_bias = torch.ones(HV, device="cuda")
        self.norm_w = torch.ones(DV, device="cuda", dtype=torch.bfloat16)

    def solve(self, layer: int, proj: torch.Tensor, parents: torch.Tensor, bits: torch.Tensor, pdl: bool):
        q, k, v, z, beta, g = gdn_tree_inputs(proj, self.conv_w[layer], self.A_log, self.dt_bias, parents,
                                              self.windows[layer], HK, DK, HV, DV, pdl=pdl)
        o, _ = gdn_tree_verify(q, k, v, g, beta, parents, self.states[layer], ancestors=bits, pdl=pdl)
        return o, z

    def mixer(self, layer: int, x: torch.Tensor, parents: torch.Tensor, bits: torch.Tensor, pdl: bool):
        o, z = self.solve(layer, F.linear(x, self.in_w[layer]), parents, bits, pdl)
        y = gated_rms_norm(o, z, self.norm_w, 1e-6)
        return F.linear(y.reshape(*y.shape[:2], HV * DV), self.out_w[layer])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", type=int, nargs="+", default=[16, 65, 129])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--ncu", action="store_true", help="one eager pass over 4 layers each way, for ncu")
    args = ap.parse_args()
    layers = Layers(4 if args.ncu else args.layers)
    for n in ([65] if args.ncu else args.ns):
        parents, bits, _ = tree(n)
        x = 0.5 * torch.randn(1, n, HIDDEN, device="cuda", dtype=torch.bfloat16)
        if args.ncu:
            for pdl in (False, True):
                for layer in range(4):
                    layers.mixer(layer, x, parents, bits, pdl)
            torch.cuda.synchronize()
            return
        proj = F.linear(x, layers.in_w[0])
        same = all(torch.equal(layers.mixer(i, x, parents, bits, False), layers.mixer(i, x, parents, bits, True))
                   for i in range(2))
        print(f"\n### N = {n}: µs per GDN layer, {args.layers} layers per graph (PDL output bit-identical: {same})\n")
        print("| part | plain | PDL | gain |\n|---|---|---|---|")
        for part, fn in (("solve", lambda i, pdl: layers.solve(i, proj, parents, bits, pdl)),
                         ("mixer", lambda i, pdl: layers.mixer(i, x, parents, bits, pdl))):
            plain = time_graph(lambda i: fn(i, False), args.layers)
            pdl = time_graph(lambda i: fn(i, True), args.layers)
            print(f"| {part} | {plain:.2f} | {pdl:.2f} | {plain - pdl:+.2f} |", flush=True)


if __name__ == "__main__":
    main()
