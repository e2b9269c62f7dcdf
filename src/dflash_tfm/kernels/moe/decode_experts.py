"""The routed experts of ONE token (a decode step) as two weight-streaming GEMV launches, in Triton.

A decode step routes one token to k experts. The grouped GEMMs (`grouped_experts.py`) serve it with four
launches per layer (the expert-blocks table, gate_up, down, the per-token sum) and 16-row tensor-core tiles of
which one row is real; at one token the step only streams weights, so the launches and their gaps are most of
its time (the 35B-A3B MoE step: 40 % of its bandwidth floor on an H100). Here:

* the gate_up kernel, grid (k, I / BN): program (j, n) streams columns n of expert ``experts[j]``'s gate and up
  rows against the token and writes ``silu(gate) · up`` into hidden row j;
* the down kernel, grid (H / BN): program n streams columns n of every chosen expert's down rows against its
  hidden row, scales each by its mixing weight and sums the k products in a fixed order into the output.

No table, no sum launch, no host read: capture-safe. An expert id of −1 (held by another expert-parallel rank)
adds nothing. Numerics follow the twin (`reference.routed_experts_reference`): fp32 dot products; gate, up,
their SwiGLU, each expert output and its weighted product rounded to the activations' dtype where the twin
rounds them; the k weighted products summed in fp32 and rounded once, as torch sums them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 16  # output columns per program: at I = 512, 8 experts x 32 programs fill an H100's 132 SMs
BLOCK_K = 128


@triton.jit
def _gate_up_kernel(x, w, experts, hidden, H, I, swe, swn, swh, BN: tl.constexpr, BK: tl.constexpr):
    """Grid (k, cdiv(I, BN)). x [H]; w [E, 2I, H]; hidden [k, I] <- silu(x W_gate^T) * (x W_up^T)."""
    j = tl.program_id(0)
    expert = tl.load(experts + j)
    if expert < 0:
        return
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = offs_n < I
    w_gate = w + expert.to(tl.int64) * swe + offs_n[:, None] * swn
    w_up = w_gate + I * swn
    acc_gate = tl.zeros([BN], dtype=tl.float32)
    acc_up = tl.zeros([BN], dtype=tl.float32)
    for k0 in range(0, H, BK):
        offs_k = k0 + tl.arange(0, BK)
        km = offs_k < H
        a = tl.load(x + offs_k, mask=km, other=0.0).to(tl.float32)
        wm = nm[:, None] & km[None, :]
        acc_gate += tl.sum(tl.load(w_gate + offs_k[None, :] * swh, mask=wm, other=0.0).to(tl.float32) * a[None, :], 1)
        acc_up += tl.sum(tl.load(w_up + offs_k[None, :] * swh, mask=wm, other=0.0).to(tl.float32) * a[None, :], 1)
    dtype = hidden.dtype.element_ty
    gate = acc_gate.to(dtype).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
    tl.store(hidden + j * I + offs_n, (act * acc_up.to(dtype).to(tl.float32)).to(dtype), mask=nm)


@triton.jit
def _down_kernel(hidden, w, experts, mixing, out, H, I, TOP_K, swe, swh, swi, BN: tl.constexpr, BK: tl.constexpr):
    """Grid (cdiv(H, BN)). hidden [k, I]; w [E, H, I]; mixing [k]; out [H] <- sum_j mixing[j] (hidden[j] W_j^T)."""
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    nm = offs_n < H
    dtype = out.dtype.element_ty
    total = tl.zeros([BN], dtype=tl.float32)
    for j in range(0, TOP_K):
        expert = tl.load(experts + j)
        if expert >= 0:
            w_e = w + expert.to(tl.int64) * swe + offs_n[:, None] * swh
            acc = tl.zeros([BN], dtype=tl.float32)
            for k0 in range(0, I, BK):
                offs_k = k0 + tl.arange(0, BK)
                km = offs_k < I
                a = tl.load(hidden + j * I + offs_k, mask=km, other=0.0).to(tl.float32)
                wt = tl.load(w_e + offs_k[None, :] * swi, mask=nm[:, None] & km[None, :], other=0.0)
                acc += tl.sum(wt.to(tl.float32) * a[None, :], 1)
            scale = tl.load(mixing + j).to(tl.float32)
            total += (acc.to(dtype).to(tl.float32) * scale).to(dtype).to(tl.float32)
    tl.store(out + offs_n, total.to(dtype), mask=nm)


def decode_routed_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
                          down: torch.Tensor) -> torch.Tensor:
    """One token: x [1, H], mixing weights [1, k] (x's dtype), expert ids [1, k] (−1: held elsewhere), gate_up
    [E, 2I, H], down [E, H, I] -> [1, H] (see the module docstring). Triton only: `grouped_experts.routed_experts`
    decides when to call it and runs the twin without Triton."""
    _, k = experts.shape
    E, two_i, H = gate_up.shape
    I = two_i // 2
    x, weights, experts = x.reshape(H).contiguous(), weights.reshape(k).contiguous(), experts.reshape(k).contiguous()
    hidden = torch.empty(k, I, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(k, triton.cdiv(I, BLOCK_N))](x, gate_up, experts, hidden, H, I, *gate_up.stride(),
                                                  BN=BLOCK_N, BK=BLOCK_K, num_warps=4)
    out = torch.empty(1, H, dtype=x.dtype, device=x.device)
    _down_kernel[(triton.cdiv(H, BLOCK_N),)](hidden, down, experts, weights, out, H, I, k, *down.stride(),
                                             BN=BLOCK_N, BK=BLOCK_K, num_warps=4)
    return out
