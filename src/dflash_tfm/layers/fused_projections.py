"""Projections with the small op before them fused in at decode: residual add + RMSNorm into the next projection
(a mixer's input projection, or gate_up), silu · mul into down.

`CausalLM` calls these for every layer; for anything but one row on CUDA they are exactly the layers' own ops
(residual add fused into the norm, `layers/linear.py` projections, `silu_and_mul`). For one row on
CUDA (a decode step) each may run as one Triton GEMV that computes its own input (`kernels/linear/fused_gemv.py`),
or as the separate kernels, whichever measured faster for this shape (`MeasuredChoice`, decided at the engine's
warm-up before a CUDA graph is captured). DFLASH_TFM_FUSED_GEMV=0 keeps the separate kernels.
"""
from __future__ import annotations

import os

import torch

from dflash_tfm.kernels.linear.fused_gemv import add_norm_gemv, silu_mul_gemv
from dflash_tfm.layers.linear import linear
from dflash_tfm.layers.measured_choice import MeasuredChoice
from dflash_tfm.layers.mlp import silu_and_mul
from dflash_tfm.layers.norm import RMSNorm

BLOCKS = {f"fused {bn}x{bk}": (bn, bk) for bn in (8, 16, 32) for bk in (256, 512)}  # GEMV rows x K chunk
# add + norm starts from the fused GEMV: timed alone, it and norm + cuBLAS came within 2 % of each other on the
# H200 (gate_up 0.0864 vs 0.0870 ms), so which one a process took flipped, and the decode steps that took the
# separate kernels for gate_up and the attention qkv were 0.3 ms slower (14.15 vs 13.78 ms, the same
# GEMV-only time; docs/PERFORMANCE.md, session 16). silu · mul was slower fused in every run: unfused default.
add_norm_choice = MeasuredChoice(default="fused 16x256")
silu_mul_choice = MeasuredChoice(default="unfused")


def fused_enabled() -> bool:
    return os.environ.get("DFLASH_TFM_FUSED_GEMV", "1") != "0"


def _decode_row(x: torch.Tensor) -> bool:
    return x.is_cuda and x.numel() == x.shape[-1] and fused_enabled()


def add_norm_linear(h: torch.Tensor, delta: torch.Tensor, norm: RMSNorm, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, weight · norm(h + delta)): the residual add, the next norm and the projection after it."""
    def unfused() -> tuple[torch.Tensor, torch.Tensor]:
        h_new, x = norm.add_forward(h, delta)
        return h_new, linear(x, weight)

    def fused(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        return add_norm_gemv(h, delta, norm.weight, norm.eps, norm.plus_one, weight, *BLOCKS[name])

    if not _decode_row(h):
        return unfused()
    key = ("add_norm", *weight.shape, h.dtype, norm.plus_one)
    name = add_norm_choice.pick(
        key, lambda: {"unfused": unfused} | {n: (lambda n=n: fused(n)) for n in BLOCKS})
    return unfused() if name == "unfused" else fused(name)


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """weight · (silu(gate) * up) for gate_up [..., 2I] laid out [gate | up]."""
    def unfused() -> torch.Tensor:
        return linear(silu_and_mul(gate_up), weight)

    def fused(name: str) -> torch.Tensor:
        return silu_mul_gemv(gate_up, weight, *BLOCKS[name])

    if not _decode_row(gate_up):
        return unfused()
    key = ("silu_mul", *weight.shape, gate_up.dtype)
    name = silu_mul_choice.pick(
        key, lambda: {"unfused": unfused} | {n: (lambda n=n: fused(n)) for n in BLOCKS})
    return unfused() if name == "unfused" else fused(name)
