"""Batch-1 GEMVs with the small op before them fused in (decode step), in Triton.

A decode step's MLP runs `h += mixer_out; x = rmsnorm(h); gate_up = W_gu x; a = silu(gate) * up; y = W_down a`.
Apart from the two weight streams, that is two tiny kernels (add + norm, silu · mul) per layer, each a few
microseconds of launch latency in a CUDA graph. Here each GEMV computes its own input while it streams its
weight rows: every program re-derives the (≤ 35k-element) input vector from L2 in chunks, so nothing else is
launched. Numerics follow the unfused path: the residual sum is rounded to the model dtype before the norm,
the norm's statistics are fp32 (`layers/norm.py` forms), the GEMV input is rounded to the model dtype, dot
products accumulate in fp32. Twins: `add_norm_gemv_reference`, `silu_mul_gemv_reference`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dflash_tfm.kernels import use_triton


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


@triton.jit
def _silu_mul_gemv_kernel(gate_up, w, y, N, I, BN: tl.constexpr, BK: tl.constexpr):
    """Grid (cdiv(N, BN),). gate_up [2I] = [gate | up]; w [N, I] row-major; y [N]."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    rm = rows < N
    acc = tl.zeros([BN], dtype=tl.float32)
    for k0 in range(0, I, BK):
        offs = k0 + tl.arange(0, BK)
        km = offs < I
        gate = tl.load(gate_up + offs, mask=km, other=0.0).to(tl.float32)
        up = tl.load(gate_up + I + offs, mask=km, other=0.0).to(tl.float32)
        # F.silu(gate) * up on model-dtype tensors: silu rounds to the dtype, the product too
        a = ((gate * tl.sigmoid(gate)).to(gate_up.dtype.element_ty).to(tl.float32) * up).to(gate_up.dtype.element_ty)
        tile = tl.load(w + rows[:, None] * I + offs[None, :], mask=rm[:, None] & km[None, :], other=0.0)
        acc += tl.sum(tile.to(tl.float32) * a.to(tl.float32)[None, :], axis=1)
    tl.store(y + rows, acc.to(y.dtype.element_ty), mask=rm)


def add_norm_gemv_reference(
    h: torch.Tensor, delta: torch.Tensor, norm_weight: torch.Tensor, eps: float, plus_one: bool, weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, W · rmsnorm(h + delta)) exactly as the unfused layers compute them."""
    from dflash_tfm.layers.norm import add_rms_norm

    h_new, x = add_rms_norm.__wrapped__(h, delta, norm_weight, eps, plus_one)
    return h_new, F.linear(x, weight)


def silu_mul_gemv_reference(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, weight)


def _one_row(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.numel() != t.shape[-1] or not t.is_contiguous():
            raise ValueError(f"expected one contiguous row [..., K], got {tuple(t.shape)}")


def add_norm_gemv(
    h: torch.Tensor, delta: torch.Tensor, norm_weight: torch.Tensor, eps: float, plus_one: bool,
    weight: torch.Tensor, block_n: int = 16, block_k: int = 512,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One row h, delta [..., K] (the residual stream and what a mixer adds to it), the norm's weight [K] and a
    weight [N, K] -> (h + delta, weight · rmsnorm(h + delta)) with the leading dims of h."""
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


def silu_mul_gemv(gate_up: torch.Tensor, weight: torch.Tensor, block_n: int = 16, block_k: int = 512) -> torch.Tensor:
    """One row gate_up [..., 2I] laid out [gate | up] and weight [N, I] -> weight · (silu(gate) * up)."""
    if not use_triton(gate_up):
        return silu_mul_gemv_reference(gate_up, weight)
    _one_row(gate_up)
    N, I = weight.shape
    y = torch.empty(*gate_up.shape[:-1], N, dtype=gate_up.dtype, device=gate_up.device)
    _silu_mul_gemv_kernel[(triton.cdiv(N, block_n),)](gate_up, weight, y, N, I, BN=block_n, BK=block_k,
                                                       num_warps=4, num_stages=3)
    return y
