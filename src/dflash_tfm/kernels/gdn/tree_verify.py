"""Gated DeltaNet tree verification: every node's output from the committed state, no state written.

``kernel="chunk"`` (the fast path, KERNELS.md steps 1–4), two launches:

1. ``_gdn_tree_gram_kernel``, one program per (row block of BT nodes, key head): the ancestor-masked Gram
   tiles ``KKᵀ`` (strict ancestors) and ``scale·QKᵀ`` (ancestors and self), computed once per KEY head and
   shared by its value heads, and the path log-decay ``G = P g`` of those value heads.
2. ``_gdn_tree_solve_kernel``, one program per (value head, dv block): block forward substitution over
   row blocks of BT = 16 (or 32) nodes. For row block i: ``rhs = β(V − e^G K S0)`` and ``O = e^G Q S0``
   (tl.dot with the state block, over dk chunks), minus/plus the already solved blocks j < i, then the
   diagonal block is inverted by repeated squaring of its nilpotent part,
   ``(I + A)⁻¹ = (I − A)(I + A²)(I + A⁴)(I + A⁸)`` for BT = 16. Solved rows ``U_i`` go to the fold
   context and are re-read (after a CTA barrier) by later row blocks of the same program.

All dots are fp32 (``input_precision="ieee"``, no TF32 rounding of the state or the solve; bf16 inputs
are upcast, which also keeps the kernels exact under Triton's CPU interpreter). ``kernel="recurrent"`` is
the baseline to beat: it steps through the nodes in order, keeping a state snapshot per node (node i
starts from its parent's).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dflash_tfm.kernels import use_triton
from dflash_tfm.kernels.gdn.tree_reference import GDNTreeContext, check_gdn_tree_inputs, gdn_tree_verify_reference
from dflash_tfm.spec.tree import ancestor_bitsets

PRECISION: tl.constexpr = tl.constexpr("ieee")  # fp32 dots on the state and the solve


@triton.jit
def _ancestor_tile(bits, rows, col0, N, W, BT: tl.constexpr):
    """bool [BT, BT]: col ∈ anc⁺(row) for cols col0 + [0, BT), from int64 bitsets ``[N, W]`` at ``bits``.
    BT divides 64, so the tile's columns share one word per row."""
    cols = col0 + tl.arange(0, BT)
    word = tl.load(bits + rows * W + col0 // 64, mask=rows < N, other=0)
    return (((word[:, None] >> (cols % 64).to(tl.int64)[None, :]) & 1) != 0) & (cols[None, :] < N)


@triton.jit
def _gdn_tree_gram_kernel(
    q, k, g, bits, kk, qk, G,
    N, W, HK, R, NP, scale,
    sq_b, sq_n, sq_h, sk_b, sk_n, sk_h, sg_b, sg_n, sg_h,
    DK: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, RP: tl.constexpr,
):
    """Grid (cdiv(N, BT), B·HK). kk, qk: [B, HK, NP, NP] fp32 (lower block triangle written); G: [B, N, HV]."""
    i = tl.program_id(0)
    b = tl.program_id(1) // HK
    h = tl.program_id(1) % HK
    rows = i * BT + tl.arange(0, BT)
    offs_k = tl.arange(0, BK)
    ld = (rows[:, None] < N) & (offs_k[None, :] < DK)
    q_i = tl.load(q + b * sq_b + rows[:, None] * sq_n + h * sq_h + offs_k[None, :], mask=ld, other=0.0)
    k_i = tl.load(k + b * sk_b + rows[:, None] * sk_n + h * sk_h + offs_k[None, :], mask=ld, other=0.0)
    q_i, k_i = q_i.to(tl.float32), k_i.to(tl.float32)
    heads = h * R + tl.arange(0, RP)
    hmask = tl.arange(0, RP) < R
    G_i = tl.zeros([BT, RP], dtype=tl.float32)
    gram = kk + (b * HK + h) * NP * NP + rows[:, None] * NP
    qgram = qk + (b * HK + h) * NP * NP + rows[:, None] * NP
    for j in range(0, i + 1):
        cols = j * BT + tl.arange(0, BT)
        ldj = (cols[:, None] < N) & (offs_k[None, :] < DK)
        k_j = tl.load(k + b * sk_b + cols[:, None] * sk_n + h * sk_h + offs_k[None, :], mask=ldj, other=0.0)
        k_j = k_j.to(tl.float32)
        anc = _ancestor_tile(bits + b * N * W, rows, j * BT, N, W, BT)
        strict = anc & (rows[:, None] != cols[None, :])
        kk_ij = tl.dot(k_i, tl.trans(k_j), input_precision=PRECISION)
        qk_ij = tl.dot(q_i, tl.trans(k_j), input_precision=PRECISION) * scale
        tl.store(gram + cols[None, :], tl.where(strict, kk_ij, 0.0))
        tl.store(qgram + cols[None, :], tl.where(anc, qk_ij, 0.0))
        g_j = tl.load(g + b * sg_b + cols[:, None] * sg_n + heads[None, :] * sg_h,
                      mask=(cols[:, None] < N) & hmask[None, :], other=0.0).to(tl.float32)
        G_i += tl.sum(tl.where(anc[:, :, None], g_j[None, :, :], 0.0), axis=1)
    HV = HK * R
    tl.store(G + (b * N + rows[:, None]) * HV + heads[None, :], G_i, mask=(rows[:, None] < N) & hmask[None, :])


@triton.jit
def _gdn_tree_solve_kernel(
    q, k, v, beta, S0, kk, qk, G, u, o,
    N, HK, R, NP, scale,
    sq_b, sq_n, sq_h, sk_b, sk_n, sk_h, sv_b, sv_n, sv_h, sb_b, sb_n, sb_h, ss_b, ss_h, ss_k,
    DK: tl.constexpr, DV: tl.constexpr, BKC: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    LOG_BT: tl.constexpr,
):
    """Grid (cdiv(dv, BV), B·HV). u: [B, N, HV, dv] fp32 (written, then re-read); o: [B, N, HV, dv]."""
    HV = HK * R
    b = tl.program_id(1) // HV
    hv = tl.program_id(1) % HV
    hk = hv // R
    offs_v = tl.program_id(0) * BV + tl.arange(0, BV)
    vm = offs_v < DV
    S_bh = S0 + b * ss_b + hv * ss_h
    gram = kk + (b * HK + hk) * NP * NP
    qgram = qk + (b * HK + hk) * NP * NP
    u_bh = u + (b * N * HV + hv) * DV
    for i in range(0, tl.cdiv(N, BT)):
        rows = i * BT + tl.arange(0, BT)
        rm = rows < N
        v_i = tl.load(v + b * sv_b + rows[:, None] * sv_n + hv * sv_h + offs_v[None, :],
                      mask=rm[:, None] & vm[None, :], other=0.0).to(tl.float32)
        b_i = tl.load(beta + b * sb_b + rows * sb_n + hv * sb_h, mask=rm, other=0.0).to(tl.float32)
        G_i = tl.load(G + (b * N + rows) * HV + hv, mask=rm, other=0.0)
        kS = tl.zeros([BT, BV], dtype=tl.float32)
        qS = tl.zeros([BT, BV], dtype=tl.float32)
        for c in range(0, DK, BKC):  # K·S0 and Q·S0 over dk chunks (S0 re-read from L1/L2): no register spills
            offs_c = c + tl.arange(0, BKC)
            cm = offs_c < DK
            S_c = tl.load(S_bh + offs_c[:, None] * ss_k + offs_v[None, :], mask=cm[:, None] & vm[None, :], other=0.0)
            ld = rm[:, None] & cm[None, :]
            k_c = tl.load(k + b * sk_b + rows[:, None] * sk_n + hk * sk_h + offs_c[None, :], mask=ld, other=0.0)
            q_c = tl.load(q + b * sq_b + rows[:, None] * sq_n + hk * sq_h + offs_c[None, :], mask=ld, other=0.0)
            kS += tl.dot(k_c.to(tl.float32), S_c, input_precision=PRECISION)
            qS += tl.dot(q_c.to(tl.float32), S_c, input_precision=PRECISION)
        eG = tl.exp(G_i)[:, None]
        rhs = b_i[:, None] * (v_i - eG * kS)
        acc = eG * qS * scale
        for j in range(0, i):  # solved blocks j < i: rhs −= A_ij U_j, O += (QKᵀ∘D)_ij U_j
            cols = j * BT + tl.arange(0, BT)
            cm = cols < N
            G_j = tl.load(G + (b * N + cols) * HV + hv, mask=cm, other=0.0)
            dec = tl.exp(tl.minimum(G_i[:, None] - G_j[None, :], 0.0))
            kk_ij = tl.load(gram + rows[:, None] * NP + cols[None, :])
            qk_ij = tl.load(qgram + rows[:, None] * NP + cols[None, :])
            u_j = tl.load(u_bh + cols[:, None] * HV * DV + offs_v[None, :], mask=cm[:, None] & vm[None, :], other=0.0)
            rhs -= tl.dot(b_i[:, None] * dec * kk_ij, u_j, input_precision=PRECISION)
            acc += tl.dot(qk_ij * dec, u_j, input_precision=PRECISION)
        dec = tl.exp(tl.minimum(G_i[:, None] - G_i[None, :], 0.0))
        a = b_i[:, None] * dec * tl.load(gram + rows[:, None] * NP + rows[None, :])  # strictly lower in-block
        x = rhs - tl.dot(a, rhs, input_precision=PRECISION)
        for _ in tl.static_range(LOG_BT - 1):
            a = tl.dot(a, a, input_precision=PRECISION)
            x += tl.dot(a, x, input_precision=PRECISION)
        tl.store(u_bh + rows[:, None] * HV * DV + offs_v[None, :], x, mask=rm[:, None] & vm[None, :])
        tl.debug_barrier()  # later row blocks of this program re-read these rows
        acc += tl.dot(tl.load(qgram + rows[:, None] * NP + rows[None, :]) * dec, x, input_precision=PRECISION)
        tl.store(o + ((b * N + rows[:, None]) * HV + hv) * DV + offs_v[None, :],
                 acc.to(o.dtype.element_ty), mask=rm[:, None] & vm[None, :])


@triton.jit
def _gdn_tree_recurrent_kernel(
    q, k, v, g, beta, parents, S0, snap, o,
    N, HK, R, scale,
    sq_b, sq_n, sq_h, sk_b, sk_n, sk_h, sv_b, sv_n, sv_h, sg_b, sg_n, sg_h, sb_b, sb_n, sb_h, ss_b, ss_h, ss_k,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    """Grid (cdiv(dv, BV), B·HV). snap: [B, N, HV, dk, dv] fp32, the state after every node."""
    HV = HK * R
    b = tl.program_id(1) // HV
    hv = tl.program_id(1) % HV
    hk = hv // R
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(0) * BV + tl.arange(0, BV)
    km = offs_k < DK
    vm = offs_v < DV
    tile = offs_k[:, None] * DV + offs_v[None, :]
    tm = km[:, None] & vm[None, :]
    S_root = tl.load(S0 + b * ss_b + hv * ss_h + offs_k[:, None] * ss_k + offs_v[None, :], mask=tm, other=0.0)
    S = S_root
    for i in range(0, N):
        p = tl.load(parents + b * N + i)
        reload = (p >= 0) & (p != i - 1)  # the previous node's state is still in registers
        S_p = tl.load(snap + ((b * N + tl.maximum(p, 0)) * HV + hv) * DK * DV + tile, mask=tm & reload, other=0.0)
        S = tl.where(p < 0, S_root, tl.where(reload, S_p, S))
        k_i = tl.load(k + b * sk_b + i * sk_n + hk * sk_h + offs_k, mask=km, other=0.0).to(tl.float32)
        q_i = tl.load(q + b * sq_b + i * sq_n + hk * sq_h + offs_k, mask=km, other=0.0).to(tl.float32)
        v_i = tl.load(v + b * sv_b + i * sv_n + hv * sv_h + offs_v, mask=vm, other=0.0).to(tl.float32)
        g_i = tl.load(g + b * sg_b + i * sg_n + hv * sg_h).to(tl.float32)
        b_i = tl.load(beta + b * sb_b + i * sb_n + hv * sb_h).to(tl.float32)
        S = S * tl.exp(g_i)
        u_i = b_i * (v_i - tl.sum(S * k_i[:, None], axis=0))
        S += k_i[:, None] * u_i[None, :]
        o_i = tl.sum(S * q_i[:, None], axis=0) * scale
        tl.store(o + ((b * N + i) * HV + hv) * DV + offs_v, o_i.to(o.dtype.element_ty), mask=vm)
        tl.store(snap + ((b * N + i).to(tl.int64) * HV + hv) * DK * DV + tile, S, mask=tm)
        tl.debug_barrier()  # a later child may reload this snapshot


def _block_v(dv: int) -> int:
    return min(32, max(16, triton.next_power_of_2(dv)))


def gdn_tree_verify(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    parents: torch.Tensor, initial_state: torch.Tensor, scale: float | None = None, kernel: str = "chunk",
    ancestors: torch.Tensor | None = None, block_size: int = 16,
) -> tuple[torch.Tensor, GDNTreeContext]:
    """Outputs of all N tree nodes of one GDN layer from the committed state; writes no state.

    q, k ``[B, N, HK, dk]`` (L2-normalised), v ``[B, N, HV, dv]``, g (≤ 0) and beta ``[B, N, HV]``,
    parents ``[B, N]`` int, initial_state ``[B, HV, dk, dv]`` fp32 (never modified). ``ancestors``:
    the step's shared bitsets ``[B, N, ceil(N/64)]`` (built from parents when omitted). ``block_size``:
    the chunk kernel's row block (16 or 32). Returns ``o [B, N, HV, dv]`` in v's dtype and the
    context for :func:`gdn_tree_commit`. CPU tensors without the Triton interpreter use the torch twin.
    """
    B, N, HK, HV, R, dk, dv = check_gdn_tree_inputs(q, k, v, g, beta, parents, initial_state)
    if kernel not in ("chunk", "recurrent"):
        raise ValueError(f"kernel must be 'chunk' or 'recurrent', got {kernel!r}")
    if block_size not in (16, 32):
        raise ValueError(f"block_size must be 16 or 32, got {block_size}")
    if not use_triton(q):
        return gdn_tree_verify_reference(q, k, v, g, beta, parents, initial_state, scale, ancestors)
    scale = dk**-0.5 if scale is None else scale
    q, k, v, S0 = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, initial_state))
    o = torch.empty(B, N, HV, dv, dtype=v.dtype, device=v.device)
    BK, BV = max(16, triton.next_power_of_2(dk)), _block_v(dv)
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3])
    grid = (triton.cdiv(dv, BV), B * HV)
    if kernel == "recurrent":
        snap = torch.empty(B, N, HV, dk, dv, dtype=torch.float32, device=v.device)
        _gdn_tree_recurrent_kernel[grid](
            q, k, v, g, beta, parents.contiguous(), S0, snap, o, N, HK, R, scale,
            *strides, *g.stride(), *beta.stride(), *S0.stride()[:3], DK=dk, DV=dv, BK=BK, BV=BV)
        return o, GDNTreeContext(initial_state=initial_state, snapshots=snap)
    bits = (ancestor_bitsets(parents) if ancestors is None else ancestors).contiguous()
    BT = block_size
    NP = triton.cdiv(N, BT) * BT
    warps = 4 if BT == 16 else 8  # no register spills on sm_90 at 27B shapes (ptxas -v)
    kk = torch.empty(B, HK, NP, NP, dtype=torch.float32, device=q.device)
    qk = torch.empty_like(kk)
    G = torch.empty(B, N, HV, dtype=torch.float32, device=q.device)
    u = torch.empty(B, N, HV, dv, dtype=torch.float32, device=q.device)
    _gdn_tree_gram_kernel[(triton.cdiv(N, BT), B * HK)](
        q, k, g, bits, kk, qk, G, N, bits.shape[-1], HK, R, NP, scale,
        *q.stride()[:3], *k.stride()[:3], *g.stride(), DK=dk, BK=BK, BT=BT, RP=triton.next_power_of_2(R),
        num_warps=warps)
    _gdn_tree_solve_kernel[grid](
        q, k, v, beta, S0, kk, qk, G, u, o, N, HK, R, NP, scale,
        *strides, *beta.stride(), *S0.stride()[:3],
        DK=dk, DV=dv, BKC=16, BV=BV, BT=BT, LOG_BT=BT.bit_length() - 1, num_warps=warps)
    return o, GDNTreeContext(initial_state=initial_state, k=k, u=u, G=G)
