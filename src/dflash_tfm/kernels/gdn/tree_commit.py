"""Rollback-free GDN commit: fold the accepted path's solved rows into a new state, one launch.

``S* = e^(G_last) S0 + Σ_{j∈path} e^(G_last−G_j) k_j u_jᵀ`` uses the ``u`` rows and path decays ``G`` that the
chunk verify pass already produced, so nothing is re-solved: per value head a ``[dk, N] × [N, dv]``
product over the accepted rows, which the kernel gathers (a path is at most one row per depth, so the fold
reads the state tile and a few rows instead of the whole tree). The recurrent baseline's context holds a
state per node instead; its commit picks the deepest accepted snapshot.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dflash_tfm.kernels import use_triton
from dflash_tfm.kernels.gdn.tree_reference import GDNTreeContext, gdn_tree_commit_reference

# The fold streams the state (302 MB for all 48 GDN layers of Qwen3.6-27B, read and written). Its launch shape, a
# dv block of 64 with 4 warps, was the fastest in every recorded H200 run: 0.100–0.106 ms for the 48 layers
# against 0.118–0.122 with 32-wide blocks and 0.114–0.140 with 8 warps (docs/data/perf/spec_step_h200_2026-12-03*.json).
FOLD_BLOCK_V, FOLD_WARPS = 64, 4


@triton.jit
def _gdn_tree_fold_kernel(
    k, u, G, accepted, S0, out,
    N, HK, R, PATHS,
    sk_b, sk_n, sk_h, ss_b, ss_h, ss_k,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BP: tl.constexpr,
    NPOW: tl.constexpr,
):
    """Grid (cdiv(dv, BV), B·HV). u: [B, N, HV, dv] fp32, G: [B, N, HV] fp32, accepted: [PATHS, N] uint8
    (batch row b reads path b % PATHS). Only the accepted rows are loaded: the path's nodes are listed in
    order (their rank = the running count of accepted nodes before them) and gathered BP at a time, so the
    cost is the state tile plus the path, not the whole tree."""
    HV = HK * R
    b = tl.program_id(1) // HV
    hv = tl.program_id(1) % HV
    hk = hv // R
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(0) * BV + tl.arange(0, BV)
    tm = (offs_k[:, None] < DK) & (offs_v[None, :] < DV)
    S0_t = tl.load(S0 + b * ss_b + hv * ss_h + offs_k[:, None] * ss_k + offs_v[None, :], mask=tm, other=0.0)
    nodes = tl.arange(0, NPOW)
    on_path = (tl.load(accepted + (b % PATHS) * N + nodes, mask=nodes < N, other=0) != 0).to(tl.int32)
    rank = tl.cumsum(on_path, axis=0) - 1
    count = tl.sum(on_path, axis=0)
    last = tl.max(tl.where(on_path != 0, nodes, -1), axis=0)  # parents precede children: deepest = largest index
    G_last = tl.load(G + (b * N + tl.maximum(last, 0)) * HV + hv)
    G_last = tl.where(last >= 0, G_last, 0.0)
    S = tl.exp(G_last) * S0_t
    for r0 in range(0, count, BP):
        slot = r0 + tl.arange(0, BP)
        pick = (on_path[None, :] != 0) & (rank[None, :] == slot[:, None])  # [BP, NPOW]: node of each slot
        idx = tl.sum(tl.where(pick, nodes[None, :], 0), axis=1)
        valid = slot < count
        G_n = tl.load(G + (b * N + idx) * HV + hv, mask=valid, other=0.0)
        w = tl.where(valid, tl.exp(tl.minimum(G_last - G_n, 0.0)), 0.0)
        k_n = tl.load(k + b * sk_b + idx[:, None] * sk_n + hk * sk_h + offs_k[None, :],
                      mask=valid[:, None] & (offs_k[None, :] < DK), other=0.0).to(tl.float32)
        u_n = tl.load(u + ((b * N + idx[:, None]) * HV + hv) * DV + offs_v[None, :],
                      mask=valid[:, None] & (offs_v[None, :] < DV), other=0.0)
        S += tl.dot(tl.trans(k_n * w[:, None]), u_n, input_precision="ieee")
    tl.store(out + ((b * HV + hv) * DK + offs_k[:, None]) * DV + offs_v[None, :], S, mask=tm)


def gdn_tree_commit(ctx: GDNTreeContext, accepted: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """New fp32 state ``[B, HV, dk, dv]`` after decoding the accepted root→node path.

    ``ctx`` from :func:`gdn_tree_verify`; ``accepted [B, N]`` bool marks the path's nodes (root included).
    ``accepted`` may also have P rows with B a multiple of P: batch row b then takes path b % P (contexts of
    several layers stacked along the batch share one path, without repeating it). Nothing accepted gives the
    initial state. ``out`` (contiguous fp32) receives the state and may be ``ctx.initial_state`` itself — each
    program reads its tile of S0 before writing that tile, so the commit then happens in place; by default a
    new tensor. No host sync.
    """
    S0 = ctx.initial_state
    B, HV, dk, dv = S0.shape
    paths = accepted.shape[0] if accepted.dim() == 2 else 0
    if not paths or B % paths:
        raise ValueError(f"accepted must be [P, N] with the batch {B} a multiple of P, got {tuple(accepted.shape)}")
    if ctx.snapshots is not None or not use_triton(S0):
        state = gdn_tree_commit_reference(ctx, accepted.repeat(B // paths, 1))
        return state if out is None else out.copy_(state)
    if out is not None and (not out.is_contiguous() or out.shape != S0.shape or out.dtype != torch.float32):
        raise ValueError(f"out must be a contiguous fp32 {tuple(S0.shape)} tensor")
    N, HK = ctx.k.shape[1], ctx.k.shape[2]
    k = ctx.k if ctx.k.stride(-1) == 1 else ctx.k.contiguous()
    S0 = S0 if S0.stride(-1) == 1 or out is S0 else S0.contiguous()
    acc = accepted.contiguous()
    acc = acc.view(torch.uint8) if acc.dtype == torch.bool else acc.to(torch.uint8)
    out = torch.empty(B, HV, dk, dv, dtype=torch.float32, device=S0.device) if out is None else out

    BV = min(FOLD_BLOCK_V, max(16, triton.next_power_of_2(dv)))
    _gdn_tree_fold_kernel[(triton.cdiv(dv, BV), B * HV)](
        k, ctx.u, ctx.G, acc, S0, out, N, HK, HV // HK, paths, *k.stride()[:3], *S0.stride()[:3],
        DK=dk, DV=dv, BK=max(16, triton.next_power_of_2(dk)), BV=BV, BP=16,
        NPOW=max(16, triton.next_power_of_2(N)), num_warps=FOLD_WARPS)
    return out
