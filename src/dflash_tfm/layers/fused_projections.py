"""The residual add + RMSNorm fused into the projection after it (a mixer's input projection, or gate_up).

`CausalLM` calls `add_norm_linear` before every such projection. For one row on CUDA (a decode step) it is one
Triton GEMV that computes its own input while it streams the weight (`kernels/linear/fused_gemv.py`); for
anything else it is the layers' own ops: the residual add fused into the norm, then the `layers/linear.py`
projection.

Why fixed, from the H200 runs (docs/PERFORMANCE.md, autoregressive decode step; docs/data/perf/ar_decode_h200_2026-12-03*.json):
timed alone, the fused GEMV and norm + cuBLAS came within 2 % of each other (gate_up 0.0864 against 0.0870 ms),
yet the decode steps that took the separate kernels were 0.37 ms slower (14.15 against 13.78 ms, the same
GEMV-only time). Of the GEMV tiles tried, 16 output rows by 256-wide K chunks was the fastest or within 0.3 % of
it at every shape (gate_up 0.0867 ms, in_proj 0.0432, attention qkv 0.0388). Fusing silu · mul into the down
projection lost in every run (0.0531 against 0.0466 ms), so that stays `silu_and_mul` then the projection.
"""
from __future__ import annotations

import torch

from dflash_tfm.kernels.linear.fused_gemv import add_norm_gemv
from dflash_tfm.layers.fp8_weight import Fp8Weight
from dflash_tfm.layers.linear import linear
from dflash_tfm.layers.norm import RMSNorm


def add_norm_linear(h: torch.Tensor, delta: torch.Tensor, norm: RMSNorm,
                    weight: torch.Tensor | Fp8Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, weight · norm(h + delta)): the residual add, the next norm and the projection after it. An FP8
    weight takes the unfused path (its weight stream does not compute the norm)."""
    if h.is_cuda and h.numel() == h.shape[-1] and not isinstance(weight, Fp8Weight):
        return add_norm_gemv(h, delta, norm.weight, norm.eps, norm.plus_one, weight)
    h_new, x = norm.add_forward(h, delta)
    return h_new, linear(x, weight)
