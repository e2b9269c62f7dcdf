"""Batch-1 GEMV with the residual add + RMSNorm before it fused in (decode step), in Triton.

A decode step runs `h += mixer_out; x = rmsnorm(h); y = W x` before every mixer's input projection and the MLP's
gate_up. Apart from the weight stream, the add + norm is a tiny kernel, a few microseconds of launch latency in
a CUDA graph. Here the GEMV computes its own input while it streams its weight rows: every program re-derives
the input vector from L2 in chunks, so nothing else is launched. Numerics follow the unfused path: the residual
sum is rounded to the model dtype before the norm, the norm's statistics are fp32 (`kernels/norm/reference.py` forms), the
GEMV input is rounded to the model dtype, dot products accumulate in fp32. Twin: `add_norm_gemv_reference`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dflash_tfm.kernels import use_triton
from dflash_tfm.kernels.norm.reference import add_rms_norm


@triton.jit
def _residual_chunk(h, delta, k0, K, BK: tl.constexpr):
    """h + delta at k0 … k0 + BK, rounded to the model dtype as the unfused add is, in fp32; and the mask."""
    offs = k0 + tl.arange(0, BK)
    km = offs < K
    s = tl.load(h + offs, mask=km, other=0.0).to(tl.float32) + tl.load(delta + offs, mask=km, other=0.0).to(tl.float32)
    return s.to(h.dtype.element_ty).to(tl.float32), offs, km


@triton.jit
def _add_norm_gemv_kernel(
    h, delta, norm_w, w, h_out, y, N, K, eps,
    PLUS_ONE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    """Grid (cdiv(N, BN),). h, delta, h_out [K]; norm_w [K]; w [N, K] row-major; y [N]."""
    pid = tl.program_id(0)
    sq = tl.zeros([BK], dtype=tl.float32)
    for k0 in range(0, K, BK):
        s, offs, km = _residual_chunk(h, delta, k0, K, BK)
        sq += s * s
        if pid == 0:
            tl.store(h_out + offs, s.to(h_out.dtype.element_ty), mask=km)
    r = tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
    rows = pid * BN + tl.arange(0, BN)
    rm = rows < N
    acc = tl.zeros([BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        s, offs, km = _residual_chunk(h, delta, k0, K, BK)
        g = tl.load(norm_w + offs, mask=km, other=0.0)
        if PLUS_ONE:  # (normed * (1 + w)) in fp32, then the model dtype
            x = (s * r * (1.0 + g.to(tl.float32))).to(h.dtype.element_ty)
        else:  # w * normed.to(dtype), a product in the model dtype
            x = (g.to(tl.float32) * (s * r).to(h.dtype.element_ty).to(tl.float32)).to(h.dtype.element_ty)
        tile = tl.load(w + rows[:, None] * K + offs[None, :], mask=rm[:, None] & km[None, :], other=0.0)
        acc += tl.sum(tile.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(y + rows, acc.to(y.dtype.element_ty), mask=rm)


def add_norm_gemv_reference(
    h: torch.Tensor, delta: torch.Tensor, norm_weight: torch.Tensor, eps: float, plus_one: bool, weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, W · rmsnorm(h + delta)) exactly as the unfused layers compute them."""
    h_new, x = add_rms_norm(h, delta, norm_weight, eps, plus_one)
    return h_new, F.linear(x, weight)


def _one_row(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.numel() != t.shape[-1] or not t.is_contiguous():
            raise ValueError(f"expected one contiguous row [..., K], got {tuple(t.shape)}")


def add_norm_gemv(
    h: torch.Tensor, delta: torch.Tensor, norm_weight: torch.Tensor, eps: float, plus_one: bool,
    weight: torch.Tensor, block_n: int = 16, block_k: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One row h, delta [..., K] (the residual stream and what a mixer adds to it), the norm's weight [K] and a
    weight [N, K] -> (h + delta, weight · rmsnorm(h + delta)) with the leading dims of h. Each program computes
    ``block_n`` outputs over ``block_k``-wide chunks of K (16 × 256: `layers/fused_projections.py` says why)."""
    if not use_triton(h):
        return add_norm_gemv_reference(h, delta, norm_weight, eps, plus_one, weight)
    _one_row(h, delta)
    N, K = weight.shape
    h_out = torch.empty_like(h)
    y = torch.empty(*h.shape[:-1], N, dtype=h.dtype, device=h.device)
    _add_norm_gemv_kernel[(triton.cdiv(N, block_n),)](
        h, delta, norm_weight, weight, h_out, y, N, K, eps, PLUS_ONE=plus_one, BN=block_n, BK=block_k,
        num_warps=4, num_stages=3)
    return h_out, y

