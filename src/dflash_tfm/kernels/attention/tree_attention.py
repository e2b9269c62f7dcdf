"""Tree attention for attention layers: every node attends to the L cached keys plus its ancestors and itself.

Flash-decoding style: one program per (block of BM query rows, kv head, split of the cache). The rows of a
block are (node, query head of the group) pairs, so GQA query heads share every K/V tile they read. Each
split runs an online softmax (fp32) over its slice of the cache; the last split also covers the N tree
keys, masked by the ancestor bitsets, so every row has at least one key (itself). With more than one split the partial outputs and log-sum-exps are merged by a second small kernel. A gated attention layer's
output gate (``o · sigmoid(gate)``) is applied by whichever kernel stores the output. Shapes: ``reference.py``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dflash_tfm.kernels import use_triton
from dflash_tfm.kernels.attention.reference import cache_lengths, check_tree_attention_inputs, tree_attention_reference


@triton.jit
def _online_softmax_step(acc, m_i, l_i, q, k_tile, v_tile, allowed, qk_scale):
    """One key tile: scores in the log2 domain, masked, merged into (acc, m_i, l_i)."""
    s = tl.dot(q, tl.trans(k_tile), input_precision="ieee") * qk_scale
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # m_i starts finite, so fully masked tiles give p = 0, alpha = 1
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    acc = acc * alpha[:, None] + tl.dot(p.to(v_tile.dtype), v_tile, input_precision="ieee")
    return acc, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _gated(out, gate_ptrs, mask, dt: tl.constexpr):
    """out rounded to dt, times sigmoid of the gate at ``gate_ptrs`` (out's shape), in fp32: as the unfused
    layer's gate computes it from the stored output."""
    g = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    return out.to(dt).to(tl.float32) * tl.sigmoid(g)


@triton.jit
def _tree_attention_kernel(
    q, k_cache, v_cache, lens, k_tree, v_tree, bits, gate, o, o_part, lse_part,
    N, H, HKV, W, qk_scale,
    sq_b, sq_n, sq_h, sc_b, sc_s, sc_h, svc_b, svc_s, svc_h, st_b, st_n, st_h, svt_b, svt_n, svt_h,
    sg_b, sg_n, sg_h,
    G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    SPLITS: tl.constexpr, GATED: tl.constexpr,
):
    """Grid (cdiv(N·G, BM), B·HKV, SPLITS); the last split also takes the tree keys. o: [B, N, H, D]; o_part:
    [SPLITS, B, N, H, D] fp32, lse_part: [SPLITS, B, N, H] fp32 (log2 domain), used only when SPLITS > 1.
    GATED (SPLITS = 1): o · sigmoid(gate), gate [B, N, H, D] strided."""
    b = tl.program_id(1) // HKV
    kvh = tl.program_id(1) % HKV
    split = tl.program_id(2)
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    node = rows // G
    head = kvh * G + rows % G
    rm = rows < N * G
    offs_d = tl.arange(0, BD)
    dm = offs_d < D
    q_t = tl.load(q + b * sq_b + node[:, None] * sq_n + head[:, None] * sq_h + offs_d[None, :],
                  mask=rm[:, None] & dm[None, :], other=0.0)
    acc = tl.zeros([BM, BD], dtype=tl.float32)
    m_i = tl.full([BM], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    L = tl.load(lens + b).to(tl.int32)
    per_split = tl.cdiv(tl.cdiv(L, SPLITS), BN) * BN
    lo = tl.minimum(split * per_split, L)
    hi = tl.minimum(lo + per_split, L)
    for start in range(lo, hi, BN):
        cols = start + tl.arange(0, BN)
        km = (cols[:, None] < hi) & dm[None, :]
        k_t = tl.load(k_cache + b * sc_b + cols[:, None] * sc_s + kvh * sc_h + offs_d[None, :], mask=km, other=0.0)
        v_t = tl.load(v_cache + b * svc_b + cols[:, None] * svc_s + kvh * svc_h + offs_d[None, :], mask=km, other=0.0)
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, q_t, k_t, v_t, (cols < hi)[None, :], qk_scale)
    last_node = tl.minimum((tl.program_id(0) + 1) * BM - 1, N * G - 1) // G  # ancestors precede: no key past it
    tree_hi = tl.where(split == SPLITS - 1, last_node + 1, 0)
    for start in range(0, tree_hi, BN):
        cols = start + tl.arange(0, BN)
        km = (cols[:, None] < N) & dm[None, :]
        k_t = tl.load(k_tree + b * st_b + cols[:, None] * st_n + kvh * st_h + offs_d[None, :], mask=km, other=0.0)
        v_t = tl.load(v_tree + b * svt_b + cols[:, None] * svt_n + kvh * svt_h + offs_d[None, :], mask=km, other=0.0)
        word = tl.load(bits + (b * N + node) * W + start // 64, mask=rm, other=0)  # BN divides 64: one word per row
        allowed = (((word[:, None] >> (cols % 64).to(tl.int64)[None, :]) & 1) != 0) & (cols[None, :] < N)
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, q_t, k_t, v_t, allowed, qk_scale)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if SPLITS == 1:
        if GATED:
            rows = gate + b * sg_b + node * sg_n + head * sg_h
            out = _gated(out, rows[:, None] + offs_d[None, :], rm[:, None] & dm[None, :], o.dtype.element_ty)
        tl.store(o + ((b * N + node[:, None]) * H + head[:, None]) * D + offs_d[None, :],
                 out.to(o.dtype.element_ty), mask=rm[:, None] & dm[None, :])
    else:
        row_id = ((split * (tl.num_programs(1) // HKV) + b) * N + node) * H + head  # index in [SPLITS, B, N, H]
        tl.store(o_part + row_id[:, None] * D + offs_d[None, :], out, mask=rm[:, None] & dm[None, :])
        tl.store(lse_part + row_id, m_i + tl.log2(tl.maximum(l_i, 1e-30)), mask=rm)  # ≈ −1e30 if the split is empty


@triton.jit
def _merge_splits_kernel(o_part, lse_part, gate, o, ROWS, N, H, sg_b, sg_n, sg_h, D: tl.constexpr,
                         BD: tl.constexpr, SPLITS: tl.constexpr, GATED: tl.constexpr):
    """Grid (B·N·H,). Softmax-weighted sum of the SPLITS (a power of two) split outputs of one (node, head) row;
    GATED: times sigmoid(gate) as in `_tree_attention_kernel`."""
    r = tl.program_id(0)
    offs_s = tl.arange(0, SPLITS)
    offs_d = tl.arange(0, BD)
    lse = tl.load(lse_part + offs_s * ROWS + r)
    w = tl.exp2(lse - tl.max(lse, axis=0))
    part = tl.load(o_part + (offs_s[:, None] * ROWS + r) * D + offs_d[None, :], mask=offs_d[None, :] < D, other=0.0)
    out = tl.sum(part * w[:, None], axis=0) / tl.sum(w, axis=0)
    if GATED:  # r = (b·N + node)·H + head
        row = gate + (r // (N * H)) * sg_b + (r // H % N) * sg_n + (r % H) * sg_h
        out = _gated(out, row + offs_d, offs_d < D, o.dtype.element_ty)
    tl.store(o + r * D + offs_d, out.to(o.dtype.element_ty), mask=offs_d < D)


MIN_KEYS_PER_SPLIT = 128


def _num_splits(rows_blocks: int, max_len: int, device: torch.device) -> int:
    """Enough programs to fill the GPU (2 per SM) but ≥ 128 cache keys per split; a power of two. (With 512,
    a 65-node tree over a 1k context ran as 56 programs on 132 SMs, a decode step as 8.)"""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    want = min(triton.cdiv(2 * sms, rows_blocks), triton.cdiv(max_len, MIN_KEYS_PER_SPLIT))
    return 1 << max(0, (want - 1).bit_length() - 1) if want > 1 else 1


def tree_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_len: int | torch.Tensor,
    k_tree: torch.Tensor, v_tree: torch.Tensor, ancestor_bitsets: torch.Tensor, scale: float | None = None,
    num_splits: int | None = None, block_n: int | None = None, block_m: int | None = None,
    num_stages: int | None = None, gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of N tree nodes over the committed cache plus their ancestors-and-self (GQA).

    q ``[B, N, H, D]`` (RoPE'd at L + depth); k_cache, v_cache ``[B, S, Hkv, D]``; cache_len an int or ``[B]``
    tensor (no host sync); k_tree, v_tree ``[B, N, Hkv, D]``; ancestor_bitsets ``[B, N, ceil(N/64)]`` int64;
    scale defaults to ``D**-0.5``; ``num_splits`` (a power of two) overrides the cache split heuristic,
    ``block_n`` (16, 32, 64) the keys per tile (default 32 at head dim > 128, else 64), ``block_m`` (16 … 128)
    the (node, head) rows per program (default: as few as the rows need, ≤ 64), ``num_stages`` Triton's
    software pipelining depth of the key loop. Returns ``o [B, N, H, D]`` in q's
    dtype; with ``gate`` (q's shape, any strides: e.g. the gate half of a gated layer's q projection)
    ``o · sigmoid(gate)`` instead, computed in fp32 from the rounded o, so the layer needs no gate kernel.
    """
    B, N, H, Hkv, D, S = check_tree_attention_inputs(q, k_cache, v_cache, k_tree, v_tree, ancestor_bitsets, gate)
    scale = D**-0.5 if scale is None else scale
    if block_n not in (None, 16, 32, 64):
        raise ValueError(f"block_n must be 16, 32 or 64, got {block_n}")
    if block_m not in (None, 16, 32, 64, 128):
        raise ValueError(f"block_m must be 16, 32, 64 or 128, got {block_m}")
    if not use_triton(q):
        return tree_attention_reference(q, k_cache, v_cache, cache_len, k_tree, v_tree, ancestor_bitsets, scale, gate)
    q, k_cache, v_cache, k_tree, v_tree = (
        t if t.stride(-1) == 1 else t.contiguous() for t in (q, k_cache, v_cache, k_tree, v_tree))
    gated = gate is not None
    gate = (gate if gate.stride(-1) == 1 else gate.contiguous()) if gated else q
    lens = cache_lengths(cache_len, B, q.device).contiguous()
    G = H // Hkv
    BD = max(16, triton.next_power_of_2(D))
    # Row tiles as small as the rows need (a decode step has G rows per kv head); no register spills on sm_90
    # (ptxas -v) for BM ≤ 64 with D = 64, 128, 256.
    BM = block_m or min(64, max(16, triton.next_power_of_2(N * G)))
    BN = block_n or (32 if BD > 128 else 64)
    m_blocks = triton.cdiv(N * G, BM)
    max_len = cache_len if isinstance(cache_len, int) else S
    splits = num_splits or _num_splits(m_blocks * B * Hkv, max_len, q.device)
    if splits & (splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {splits}")
    o = torch.empty(B, N, H, D, dtype=q.dtype, device=q.device)
    part_shape = (splits, B, N, H) if splits > 1 else (1,)
    o_part = torch.empty(*part_shape, D, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(part_shape, dtype=torch.float32, device=q.device)
    _tree_attention_kernel[(m_blocks, B * Hkv, splits)](
        q, k_cache, v_cache, lens, k_tree, v_tree, ancestor_bitsets.contiguous(), gate, o, o_part, lse_part,
        N, H, Hkv, ancestor_bitsets.shape[-1], scale * math.log2(math.e),
        *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3], *k_tree.stride()[:3], *v_tree.stride()[:3],
        *gate.stride()[:3], G=G, D=D, BD=BD, BM=BM, BN=BN, SPLITS=splits, GATED=gated,
        num_warps=8 if BD >= 128 else 4, **({} if num_stages is None else {"num_stages": num_stages}))
    if splits > 1:
        _merge_splits_kernel[(B * N * H,)](o_part, lse_part, gate, o, B * N * H, N, H, *gate.stride()[:3],
                                           D=D, BD=BD, SPLITS=splits, GATED=gated)
    return o


@dataclass
class AcceptedSlots:
    """Where a committed path's K/V go, shared by every attention layer of one commit: row ``rows[b, t]``,
    cache slot ``dst[b, t] = L + t`` receives tree node ``src[b, t]``; ``lengths`` = L + a + 1 per row."""

    rows: torch.Tensor
    dst: torch.Tensor
    src: torch.Tensor
    lengths: torch.Tensor


def accepted_slots(cache_len: int | torch.Tensor, path_indices: torch.Tensor, batch: int, device: torch.device) -> AcceptedSlots:
    """path_indices ``[B, M]`` (or ``[M]``): the accepted path's node indices in order, root (0) first, padded
    with −1. Padding repeats the row's last valid (slot, node) pair, so every write is well defined (duplicates
    write identical values) and nothing syncs the host. A row that accepted nothing (a batch row still in its
    prompt) keeps its length; it writes its root's K/V into slot L, past its length, as scratch."""
    path = path_indices.long().to(device).reshape(batch, -1)
    L = cache_lengths(cache_len, batch, device)
    count = (path >= 0).sum(-1, keepdim=True)                                   # a + 1 (the root), or 0
    t = torch.minimum(torch.arange(path.shape[1], device=device), count - 1).clamp(min=0)  # [B, M]
    rows = torch.arange(batch, device=device)[:, None].expand_as(t)
    src = path.gather(1, t).clamp(min=0)
    return AcceptedSlots(rows=rows, dst=L[:, None] + t, src=src, lengths=L + count[:, 0])


def write_accepted_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k_tree: torch.Tensor, v_tree: torch.Tensor, slots: AcceptedSlots,
) -> None:
    """Move the accepted nodes' K/V (``[B, N, Hkv, D]``) into cache slots ``L … L+a`` (``[B, S, Hkv, D]``) in place;
    with a leading layer dim on all four (``[L, B, ...]``, the cache's stacks) every layer in one launch."""
    lead = (slice(None),) * (k_cache.dim() - 4)
    k_cache[(*lead, slots.rows, slots.dst)] = k_tree[(*lead, slots.rows, slots.src)]
    v_cache[(*lead, slots.rows, slots.dst)] = v_tree[(*lead, slots.rows, slots.src)]


def compact_accepted_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, cache_len: int | torch.Tensor,
    k_tree: torch.Tensor, v_tree: torch.Tensor, path_indices: torch.Tensor,
) -> torch.Tensor:
    """Move the root's and accepted nodes' K/V into cache slots ``L … L+a`` in place; return the new lengths
    ``L + a + 1`` as a ``[B]`` long tensor (one layer; a model commit computes the slots once for all layers)."""
    slots = accepted_slots(cache_len, path_indices, k_cache.shape[0], k_cache.device)
    write_accepted_kv(k_cache, v_cache, k_tree, v_tree, slots)
    return slots.lengths
