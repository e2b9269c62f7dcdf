"""Gated DeltaNet tree verification: every node's output from the committed state, no state written.

``kernel="chunk"`` (the fast path, KERNELS.md steps 1–4) takes three launches, the two before the last taking
everything that does not depend on earlier solved rows off the serial path:

1. ``_gdn_tree_gram_kernel``, one program per (row block of BT nodes, column block, key head): the
   ancestor-masked Gram tiles ``KKᵀ`` (strict ancestors) and ``scale·QKᵀ`` (ancestors and self), computed once
   per KEY head and shared by its value heads, and (column block 0) the path log-decay ``G = P g`` of those
   value heads;
2. ``_gdn_tree_prep_kernel``, one program per (row block i, dv block, value head), all independent: the
   diagonal block inverse ``T_i = (I + A_ii)⁻¹`` by repeated squaring of its nilpotent part,
   ``(I + A)⁻¹ = (I − A)(I + A²)(I + A⁴)(I + A⁸)`` for BT = 16, the state products
   ``W_i = T_i β_i(V_i − e^G_i K_i S0)`` (written into ``u``) and ``O0_i = e^G_i Q_i S0`` (fp32 scratch), and
   per value head the tiles ``Ã_ij = T_i A_ij`` (j < i) and ``M_ij = (QKᵀ ∘ D)_ij`` (j ≤ i), shared
   round-robin by the dv-block programs of a row block;
3. ``_gdn_tree_subst_kernel``, one program per (value head, dv block): only the block substitution
   ``U_i = W_i − Σ_{j<i} Ã_ij U_j`` and ``O_i = O0_i + Σ_{j≤i} M_ij U_j`` (JW columns of solved rows per dot),
   in place in ``u``.

The kernels are compiled once for all N (``do_not_specialize``). This split solver replaced a serial one (the
whole substitution, state products included, in one launch after the Gram tiles: 64.4 against 56.6 µs per
layer at N = 65 on the H200, docs/PERFORMANCE.md); the sweeps' other losers (a row-block Gram, the Gram tiles
recomputed inside the prep, the front that fused the Gram kernel with the verify inputs) were removed.

Precision (`ChunkSolve`): ``precision`` is the ``tl.dot`` input precision of the products with the state (K·S0,
Q·S0, the only large ones), ``solve_precision`` that of every other dot (Gram tiles, block inverses,
substitution). ``"ieee"`` is fp32 (no TF32 rounding; bf16 inputs are upcast), ``"tf32x3"`` uses tensor cores at
about fp32 accuracy, ``"tf32"`` rounds the inputs to 10 mantissa bits; under Triton's CPU interpreter all three
run as fp32. The state products default to "tf32", the rest to "tf32" for 16-bit inputs of large trees and
"ieee" otherwise (`default_solve_precision`).

``kernel="recurrent"`` is the baseline to beat: it steps through the nodes in order, keeping a state snapshot
per node (node i starts from its parent's).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dflash_tfm.kernels import TRITON_INTERPRETED, use_triton
from dflash_tfm.kernels.gdn.tree_reference import GDNTreeContext, check_gdn_tree_inputs, gdn_tree_verify_reference
from dflash_tfm.tree import ancestor_bitsets

PRECISIONS = ("ieee", "tf32", "tf32x3")


@triton.jit
def _ancestor_tile(bits, rows, col0, N, W, BT: tl.constexpr):
    """bool [BT, BT]: col ∈ anc⁺(row) for cols col0 + [0, BT), from int64 bitsets ``[N, W]`` at ``bits``.
    BT divides 64, so the tile's columns share one word per row."""
    cols = col0 + tl.arange(0, BT)
    word = tl.load(bits + rows * W + col0 // 64, mask=rows < N, other=0)
    return (((word[:, None] >> (cols % 64).to(tl.int64)[None, :]) & 1) != 0) & (cols[None, :] < N)


@triton.jit
def _gram_tiles(q_i, k_i, k_j, scale, PREC: tl.constexpr, NATIVE: tl.constexpr):
    """K_i·K_jᵀ and scale·Q_i·K_jᵀ in fp32. NATIVE: q_i, k_i (and k_j) are 16-bit and the dots take them as they
    are (tensor cores; the products are exact in fp32, so only the summation order differs from fp32 "ieee");
    else q_i, k_i are fp32 and the dots run at PREC."""
    k_j = k_j.to(k_i.dtype)
    if NATIVE:
        kk = tl.dot(k_i, tl.trans(k_j))
        qk = tl.dot(q_i, tl.trans(k_j))
    else:
        kk = tl.dot(k_i, tl.trans(k_j), input_precision=PREC)
        qk = tl.dot(q_i, tl.trans(k_j), input_precision=PREC)
    return kk, qk * scale


@triton.jit
def _store_gram_tile(kk, qk, bits, q_i, k_i, k_j, rows, j, bh, N, W, NP, scale, BT: tl.constexpr,
                    PREC: tl.constexpr, NATIVE: tl.constexpr):
    """Tile (row block ``rows``, column block j) of key head bh's Gram matrices [NP, NP]: K·Kᵀ on strict
    ancestors and scale·Q·Kᵀ on ancestors-and-self, zero elsewhere (bits: this batch entry's bitsets)."""
    cols = j * BT + tl.arange(0, BT)
    anc = _ancestor_tile(bits, rows, j * BT, N, W, BT)
    strict = anc & (rows[:, None] != cols[None, :])
    kk_ij, qk_ij = _gram_tiles(q_i, k_i, k_j, scale, PREC, NATIVE)
    tile = bh * NP * NP + rows[:, None] * NP + cols[None, :]
    tl.store(kk + tile, tl.where(strict, kk_ij, 0.0))
    tl.store(qk + tile, tl.where(anc, qk_ij, 0.0))


@triton.jit(do_not_specialize=["N", "W"])  # one compile for every tree size
def _gdn_tree_gram_kernel(
    q, k, g, bits, kk, qk, G,
    N, W, HK, R, NP, scale,
    sq_b, sq_n, sq_h, sk_b, sk_n, sk_h, sg_b, sg_n, sg_h,
    DK: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, RP: tl.constexpr,
    PREC: tl.constexpr, NATIVE: tl.constexpr,
):
    """Grid (cdiv(N, BT), B·HK, cdiv(N, BT)): row block i, column block j (programs above the diagonal do
    nothing; column block 0 also sums G). kk, qk: [B, HK, NP, NP] fp32 (lower block triangle written); G:
    [B, N, HV]. NATIVE: see _gram_tiles."""
    i = tl.program_id(0)
    b = tl.program_id(1) // HK
    h = tl.program_id(1) % HK
    rows = i * BT + tl.arange(0, BT)
    offs_k = tl.arange(0, BK)
    ld = (rows[:, None] < N) & (offs_k[None, :] < DK)
    q_i = tl.load(q + b * sq_b + rows[:, None] * sq_n + h * sq_h + offs_k[None, :], mask=ld, other=0.0)
    k_i = tl.load(k + b * sk_b + rows[:, None] * sk_n + h * sk_h + offs_k[None, :], mask=ld, other=0.0)
    if not NATIVE:
        q_i, k_i = q_i.to(tl.float32), k_i.to(tl.float32)
    j_lo = tl.program_id(2)
    for j in range(j_lo, tl.minimum(j_lo + 1, i + 1)):  # empty above the diagonal
        cols = j * BT + tl.arange(0, BT)
        ldj = (cols[:, None] < N) & (offs_k[None, :] < DK)
        k_j = tl.load(k + b * sk_b + cols[:, None] * sk_n + h * sk_h + offs_k[None, :], mask=ldj, other=0.0)
        _store_gram_tile(kk, qk, bits + b * N * W, q_i, k_i, k_j, rows, j, b * HK + h, N, W, NP, scale, BT, PREC,
                        NATIVE)
    if j_lo == 0:  # G of this row block's value heads
        _path_decay_rows(g, bits + b * N * W, G + b * N * HK * R, rows, N, W, h * R, R, HK * R, b * sg_b, sg_n,
                         sg_h, RP)


@triton.jit
def _path_decay_rows(g, bits, G, rows, N, W, h0, R, HV, g_off, sg_n, sg_h, RP: tl.constexpr):
    """G[rows, h0 + r] = Σ_{m ∈ anc⁺(row)} g[m, h0 + r] for r < R, one bitset word (64 nodes) per step: each
    step is one 0/1-masked dot ([rows, 64] · [64, heads], fp32 FMA), so there is no serial chain of loads per
    column block. G: [N, HV] of one batch entry; RP ≥ 16 (a dot's width) covers R."""
    heads = h0 + tl.arange(0, RP)
    hmask = tl.arange(0, RP) < R
    offs = tl.arange(0, 64)
    G_i = tl.zeros([rows.shape[0], RP], dtype=tl.float32)
    for w in range(0, W):
        cols = w * 64 + offs
        word = tl.load(bits + rows * W + w, mask=rows < N, other=0)
        anc = ((word[:, None] >> offs.to(tl.int64)[None, :]) & 1).to(tl.float32)
        gm = (cols[:, None] < N) & hmask[None, :]
        g_w = tl.load(g + g_off + cols[:, None] * sg_n + heads[None, :] * sg_h, mask=gm, other=0.0).to(tl.float32)
        G_i += tl.dot(anc, g_w, input_precision="ieee")
    tl.store(G + rows[:, None] * HV + heads[None, :], G_i, mask=(rows[:, None] < N) & hmask[None, :])


@triton.jit
def _block_inverse(a, rows, LOG_BT: tl.constexpr, SPREC: tl.constexpr):
    """(I + A)⁻¹ = (I − A)(I + A²)(I + A⁴)… for a strictly lower [BT, BT] tile A (nilpotent of order BT)."""
    t = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0) - a
    for _ in tl.static_range(LOG_BT - 1):
        a = tl.dot(a, a, input_precision=SPREC)
        t += tl.dot(a, t, input_precision=SPREC)
    return t


@triton.jit
def _prep_state_rows(
    q, k, v, S0, w, o0, t, b_i, G_i, rows, b, hv, hk, vb, N, HV, scale,
    sq_b, sq_n, sq_h, sk_b, sk_n, sk_h, sv_b, sv_n, sv_h, ss_b, ss_h, ss_k,
    DK: tl.constexpr, DV: tl.constexpr, BKC: tl.constexpr, BVS: tl.constexpr, BT: tl.constexpr,
    PREC: tl.constexpr, SPREC: tl.constexpr,
):
    """Rows ``rows``, dv block vb: w = T β(V − e^G K S0) and o0 = e^G Q S0 (scaled), both [B, N, HV, dv] fp32."""
    rm = rows < N
    offs_v = vb * BVS + tl.arange(0, BVS)
    vm = offs_v < DV
    S_bh = S0 + b * ss_b + hv * ss_h
    kS = tl.zeros([BT, BVS], dtype=tl.float32)
    qS = tl.zeros([BT, BVS], dtype=tl.float32)
    for c in range(0, DK, BKC):
        offs_c = c + tl.arange(0, BKC)
        cm = offs_c < DK
        S_c = tl.load(S_bh + offs_c[:, None] * ss_k + offs_v[None, :], mask=cm[:, None] & vm[None, :], other=0.0)
        ld = rm[:, None] & cm[None, :]
        k_c = tl.load(k + b * sk_b + rows[:, None] * sk_n + hk * sk_h + offs_c[None, :], mask=ld, other=0.0)
        q_c = tl.load(q + b * sq_b + rows[:, None] * sq_n + hk * sq_h + offs_c[None, :], mask=ld, other=0.0)
        kS += tl.dot(k_c.to(tl.float32), S_c, input_precision=PREC)
        qS += tl.dot(q_c.to(tl.float32), S_c, input_precision=PREC)
    v_i = tl.load(v + b * sv_b + rows[:, None] * sv_n + hv * sv_h + offs_v[None, :],
                  mask=rm[:, None] & vm[None, :], other=0.0).to(tl.float32)
    eG = tl.exp(G_i)[:, None]
    w_i = tl.dot(t, b_i[:, None] * (v_i - eG * kS), input_precision=SPREC)
    out = ((b * N + rows[:, None]) * HV + hv) * DV + offs_v[None, :]
    tl.store(w + out, w_i, mask=rm[:, None] & vm[None, :])
    tl.store(o0 + out, eG * qS * scale, mask=rm[:, None] & vm[None, :])


@triton.jit(do_not_specialize=["N"])  # one compile for every tree size
def _gdn_tree_prep_kernel(
    q, k, v, beta, S0, kk, qk, G, w, o0, At, M,
    N, HK, R, NP, NSV, scale,
    sq_b, sq_n, sq_h, sk_b, sk_n, sk_h, sv_b, sv_n, sv_h, sb_b, sb_n, sb_h, ss_b, ss_h, ss_k,
    DK: tl.constexpr, DV: tl.constexpr, BKC: tl.constexpr, BVS: tl.constexpr, BT: tl.constexpr,
    LOG_BT: tl.constexpr, PREC: tl.constexpr, SPREC: tl.constexpr,
):
    """Step 2. Grid (cdiv(N, BT), NSV = cdiv(dv, BVS), B·HV), all programs independent.
    w, o0: [B, N, HV, dv] fp32 (T_i β(V − e^G K S0) and e^G Q S0); At, M: [B, HV, NP, NP] fp32 (lower block
    triangle: Ã strictly below the diagonal blocks, M including them)."""
    HV = HK * R
    i = tl.program_id(0)
    vb = tl.program_id(1)
    b = tl.program_id(2) // HV
    hv = tl.program_id(2) % HV
    hk = hv // R
    rows = i * BT + tl.arange(0, BT)
    rm = rows < N
    b_i = tl.load(beta + b * sb_b + rows * sb_n + hv * sb_h, mask=rm, other=0.0).to(tl.float32)
    G_i = tl.load(G + (b * N + rows) * HV + hv, mask=rm, other=0.0)
    gram = kk + (b * HK + hk) * NP * NP + rows[:, None] * NP
    qgram = qk + (b * HK + hk) * NP * NP + rows[:, None] * NP
    dec = tl.exp(tl.minimum(G_i[:, None] - G_i[None, :], 0.0))
    t = _block_inverse(b_i[:, None] * dec * tl.load(gram + rows[None, :]), rows, LOG_BT, SPREC)
    _prep_state_rows(q, k, v, S0, w, o0, t, b_i, G_i, rows, b, hv, hk, vb, N, HV, scale,
                     sq_b, sq_n, sq_h, sk_b, sk_n, sk_h, sv_b, sv_n, sv_h, ss_b, ss_h, ss_k,
                     DK, DV, BKC, BVS, BT, PREC, SPREC)
    # Ã_ij = T_i A_ij (j < i), M_ij = (QKᵀ∘D)_ij (j ≤ i): column blocks shared round-robin by the NSV programs
    mat = (b * HV + hv) * NP * NP + rows[:, None] * NP
    for j in range(vb, i + 1, NSV):
        cols = j * BT + tl.arange(0, BT)
        G_j = tl.load(G + (b * N + cols) * HV + hv, mask=cols < N, other=0.0)
        dec = tl.exp(tl.minimum(G_i[:, None] - G_j[None, :], 0.0))
        tl.store(M + mat + cols[None, :], tl.load(qgram + cols[None, :]) * dec)
        if j < i:
            a_ij = b_i[:, None] * dec * tl.load(gram + cols[None, :])
            tl.store(At + mat + cols[None, :], tl.dot(t, a_ij, input_precision=SPREC))


@triton.jit(do_not_specialize=["N"])  # one compile for every tree size
def _gdn_tree_subst_kernel(
    u, o0, At, M, o,
    N, HV, NP,
    DV: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, JW: tl.constexpr, SPREC: tl.constexpr,
):
    """Step 3. Grid (cdiv(dv, BV), B·HV). u holds W on entry and the solved U on exit (each row
    block read, then overwritten by the same program); later row blocks re-read solved rows after a barrier.
    The next row block's W, O0 and diagonal M tile, which do not depend on the solve, are loaded a step ahead."""
    b = tl.program_id(1) // HV
    hv = tl.program_id(1) % HV
    offs_v = tl.program_id(0) * BV + tl.arange(0, BV)
    vm = offs_v[None, :] < DV
    u_bh = u + (b * N * HV + hv) * DV + offs_v[None, :]
    o0_bh = o0 + (b * N * HV + hv) * DV + offs_v[None, :]
    mat = M + (b * HV + hv) * NP * NP
    amat = At + (b * HV + hv) * NP * NP
    rows = tl.arange(0, BT)
    rm = rows[:, None] < N
    x = tl.load(u_bh + rows[:, None] * HV * DV, mask=rm & vm, other=0.0)
    acc = tl.load(o0_bh + rows[:, None] * HV * DV, mask=rm & vm, other=0.0)
    m_d = tl.load(mat + rows[:, None] * NP + rows[None, :])
    for i in range(0, tl.cdiv(N, BT)):
        rows = i * BT + tl.arange(0, BT)
        rm = rows[:, None] < N
        nxt = rows + BT
        nm = nxt[:, None] < N
        x_n = tl.load(u_bh + nxt[:, None] * HV * DV, mask=nm & vm, other=0.0)
        acc_n = tl.load(o0_bh + nxt[:, None] * HV * DV, mask=nm & vm, other=0.0)
        m_n = tl.load(mat + nxt[:, None] * NP + nxt[None, :], mask=nm, other=0.0)
        row0 = i * BT
        for j0 in range(0, row0, JW):  # solved rows [0, row0), JW at a time: all < N
            cols = j0 + tl.arange(0, JW)
            cm = cols < row0
            u_j = tl.load(u_bh + cols[:, None] * HV * DV, mask=cm[:, None] & vm, other=0.0)
            at = tl.load(amat + rows[:, None] * NP + cols[None, :], mask=cm[None, :], other=0.0)
            m = tl.load(mat + rows[:, None] * NP + cols[None, :], mask=cm[None, :], other=0.0)
            x -= tl.dot(at, u_j, input_precision=SPREC)
            acc += tl.dot(m, u_j, input_precision=SPREC)
        tl.store(u_bh + rows[:, None] * HV * DV, x, mask=rm & vm)
        tl.debug_barrier()  # later row blocks of this program re-read these rows
        acc += tl.dot(m_d, x, input_precision=SPREC)
        tl.store(o + ((b * N + rows[:, None]) * HV + hv) * DV + offs_v[None, :], acc.to(o.dtype.element_ty),
                 mask=rm & vm)
        x, acc, m_d = x_n, acc_n, m_n


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


TF32_SOLVE_MIN_NODES = 32  # the default solve runs at tf32 from here on for 16-bit inputs (see `ChunkSolve`)
HALF_DTYPES = (torch.bfloat16, torch.float16)


def default_solve_precision(dtype: torch.dtype, n: int) -> str:
    """The solve's dots (Gram tiles, block inverses, substitution) by default: "tf32" for 16-bit inputs of more
    than `TF32_SOLVE_MIN_NODES` nodes, else fp32 "ieee" (see `ChunkSolve`)."""
    return "tf32" if dtype in HALF_DTYPES and n > TF32_SOLVE_MIN_NODES else "ieee"


@dataclass(frozen=True)
class ChunkSolve:
    """Launch and precision settings of the chunk kernel. The defaults are the fastest configuration of the H200
    sweeps at Qwen3.6-27B shapes (``python -m benchmarks.bench_tree_kernels --sweep``: 10.7 / 21.8 / 42.9 µs per
    layer at N = 16 / 65 / 129, against 14.3 / 64.4 / 137.0 for the first, serial fp32 solver; errors vs the fp32
    twin: o 6.6e-3 with bf16 outputs, u 6.3e-4; docs/PERFORMANCE.md, tree verification kernels); the others are the sweep's
    axes.

    ``block_size``: the row block BT (16 or 32). ``precision`` / ``solve_precision``: "ieee" | "tf32" | "tf32x3"
    for the state products / every other dot; ``solve_precision=None`` picks "tf32" with ``solve_width`` 32 for
    16-bit inputs of more than `TF32_SOLVE_MIN_NODES` nodes (10-bit mantissas, finer than the inputs' own
    rounding: 21.8 against 26.4 µs at N = 65, 42.9 against 57.4 at 129, but 12.0 against 10.6 at 16), else fp32
    "ieee", so fp32 inputs are solved at fp32 accuracy. ``block_v``: the dv block of the substitution (16, 32,
    64; None: 32 when dv ≥ 32); ``num_warps`` / ``num_stages``: its launch (None: 4 warps for BT = 16, 8 for 32;
    Triton's stages). ``state_block_v``: the dv block of the state products (16 … 128). ``solve_width``: solved
    rows per dot in the substitution (a power-of-2 multiple of ``block_size``; None: ``block_size``).
    ``gram_native``: the Gram tiles' dots take bf16 / fp16 q and k as they come (tensor cores, exact products,
    fp32 sums: 26.4 against 32.6 µs at N = 65) instead of at ``solve_precision``."""

    block_size: int = 16
    precision: str = "tf32"
    solve_precision: str | None = None
    block_v: int | None = 32
    num_warps: int | None = None
    num_stages: int | None = 1
    state_block_v: int = 64
    solve_width: int | None = None
    gram_native: bool = True

    def validate(self) -> None:
        if self.block_size not in (16, 32):
            raise ValueError(f"block_size must be 16 or 32, got {self.block_size}")
        if self.precision not in PRECISIONS or self.solve_precision not in (*PRECISIONS, None):
            raise ValueError(f"precision and solve_precision must be in {PRECISIONS}, got {self.precision!r}, "
                             f"{self.solve_precision!r}")
        if self.block_v is not None and self.block_v not in (16, 32, 64):
            raise ValueError(f"block_v must be 16, 32 or 64, got {self.block_v}")
        if self.state_block_v not in (16, 32, 64, 128):
            raise ValueError(f"state_block_v must be 16, 32, 64 or 128, got {self.state_block_v}")
        width = self.block_size if self.solve_width is None else self.solve_width
        if width < self.block_size or width & (width - 1):
            raise ValueError(f"solve_width must be a power-of-2 multiple of block_size, got {self.solve_width}")

    def for_tree(self, dtype: torch.dtype, n: int) -> tuple[str, int]:
        """(solve precision, solve width) for n nodes of ``dtype``, the defaults resolved."""
        if self.solve_precision is not None:
            return self.solve_precision, self.solve_width or self.block_size
        precision = default_solve_precision(dtype, n)
        width = self.solve_width or (32 if precision == "tf32" else self.block_size)
        return precision, width


def _block_v(dv: int) -> int:
    return min(32, max(16, triton.next_power_of_2(dv)))


def gdn_tree_verify(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    parents: torch.Tensor, initial_state: torch.Tensor, scale: float | None = None, kernel: str = "chunk",
    ancestors: torch.Tensor | None = None, *, solve: ChunkSolve = ChunkSolve(),
    u_out: torch.Tensor | None = None, G_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, GDNTreeContext]:
    """Outputs of all N tree nodes of one GDN layer from the committed state; writes no state.

    q, k ``[B, N, HK, dk]`` (L2-normalised), v ``[B, N, HV, dv]``, g (≤ 0) and beta ``[B, N, HV]``,
    parents ``[B, N]`` int, initial_state ``[B, HV, dk, dv]`` fp32 (never modified). ``ancestors``:
    the step's shared bitsets ``[B, N, ceil(N/64)]`` (built from parents when omitted). ``solve``: the chunk
    kernel's settings (`ChunkSolve`). Returns ``o [B, N, HV, dv]`` in v's dtype and the context for
    :func:`gdn_tree_commit`. CPU tensors without the Triton interpreter use the torch twin.

    ``u_out`` / ``G_out`` (chunk kernel, both or neither; contiguous fp32 ``[B, N, HV, dv]`` / ``[B, N, HV]``)
    receive the context's solved rows and path decays instead of new tensors: slices of layer-stacked
    buffers let the model's commit fold every layer in one launch without stacking copies.
    """
    B, N, HK, HV, R, dk, dv = check_gdn_tree_inputs(q, k, v, g, beta, parents, initial_state)
    if kernel not in ("chunk", "recurrent"):
        raise ValueError(f"kernel must be 'chunk' or 'recurrent', got {kernel!r}")
    solve.validate()
    if (u_out is None) != (G_out is None) or (u_out is not None and kernel != "chunk"):
        raise ValueError("u_out and G_out come together, for the chunk kernel (the recurrent one keeps snapshots)")
    for name, buf, shape in (("u_out", u_out, (B, N, HV, dv)), ("G_out", G_out, (B, N, HV))):
        if buf is not None and (tuple(buf.shape) != shape or buf.dtype != torch.float32 or not buf.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous fp32 {shape} tensor, got {tuple(buf.shape)} {buf.dtype}")
    if not use_triton(q):
        o, ctx = gdn_tree_verify_reference(q, k, v, g, beta, parents, initial_state, scale, ancestors)
        if u_out is None:
            return o, ctx
        return o, GDNTreeContext(initial_state=initial_state, k=ctx.k, u=u_out.copy_(ctx.u), G=G_out.copy_(ctx.G))
    scale = dk**-0.5 if scale is None else scale
    q, k, v, S0 = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, initial_state))
    o = torch.empty(B, N, HV, dv, dtype=v.dtype, device=v.device)
    BK = max(16, triton.next_power_of_2(dk))
    BV = _block_v(dv) if solve.block_v is None else solve.block_v
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3])
    grid = (triton.cdiv(dv, BV), B * HV)
    if kernel == "recurrent":
        snap = torch.empty(B, N, HV, dk, dv, dtype=torch.float32, device=v.device)
        _gdn_tree_recurrent_kernel[grid](
            q, k, v, g, beta, parents.contiguous(), S0, snap, o, N, HK, R, scale,
            *strides, *g.stride(), *beta.stride(), *S0.stride()[:3], DK=dk, DV=dv, BK=BK, BV=BV)
        return o, GDNTreeContext(initial_state=initial_state, snapshots=snap)
    solve_precision, JW = solve.for_tree(q.dtype, N)
    bits = (ancestor_bitsets(parents) if ancestors is None else ancestors).contiguous()
    BT = solve.block_size
    nb = triton.cdiv(N, BT)
    NP = nb * BT
    LOG_BT = BT.bit_length() - 1
    warps = 4 if BT == 16 else 8  # no register spills on sm_90 at 27B shapes (ptxas -v)
    G = torch.empty(B, N, HV, dtype=torch.float32, device=q.device) if G_out is None else G_out
    u = torch.empty(B, N, HV, dv, dtype=torch.float32, device=q.device) if u_out is None else u_out
    # The Gram dots take 16-bit q, k as they are; not under Triton's CPU interpreter, which gets 16-bit dots wrong
    # (garbage, not rounding): there the Gram tiles stay fp32.
    native = solve.gram_native and not TRITON_INTERPRETED and q.dtype in HALF_DTYPES and k.dtype == q.dtype
    kk = torch.empty(B, HK, NP, NP, dtype=torch.float32, device=q.device)
    qk = torch.empty_like(kk)
    _gdn_tree_gram_kernel[(nb, B * HK, nb)](
        q, k, g, bits, kk, qk, G, N, bits.shape[-1], HK, R, NP, scale,
        *q.stride()[:3], *k.stride()[:3], *g.stride(), DK=dk, BK=BK, BT=BT, RP=max(16, triton.next_power_of_2(R)),
        PREC=solve_precision, NATIVE=native, num_warps=warps)
    o0 = torch.empty_like(u)
    At = torch.empty(B, HV, NP, NP, dtype=torch.float32, device=q.device)
    M = torch.empty_like(At)
    NSV = triton.cdiv(dv, solve.state_block_v)
    _gdn_tree_prep_kernel[(nb, NSV, B * HV)](
        q, k, v, beta, S0, kk, qk, G, u, o0, At, M, N, HK, R, NP, NSV, scale,
        *strides, *beta.stride(), *S0.stride()[:3], DK=dk, DV=dv, BKC=min(32, BK), BVS=solve.state_block_v, BT=BT,
        LOG_BT=LOG_BT, PREC=solve.precision, SPREC=solve_precision, num_warps=warps)
    launch = {"num_warps": warps if solve.num_warps is None else solve.num_warps}
    if solve.num_stages is not None:
        launch["num_stages"] = solve.num_stages
    _gdn_tree_subst_kernel[grid](
        u, o0, At, M, o, N, HV, NP, DV=dv, BV=BV, BT=BT, JW=JW, SPREC=solve_precision, **launch)
    return o, GDNTreeContext(initial_state=initial_state, k=k, u=u, G=G)
