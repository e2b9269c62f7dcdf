"""The kernels of the batched Weaver step of a tree round (W ≤ 16 node rows): five launches per Weaver block.

Why: a round multiplies a handful of rows by the Weaver weights (59 MB at the published 27B shapes, ~14 µs of
streaming), but as torch ops — gathers, norms, RoPE, the masked softmax, activations and residual adds between
four projections — it is ~25 launches, and inside a CUDA graph each costs a few µs (docs/PERFORMANCE.md,
speculative step parts). Here every projection computes its own input and output glue while it streams its
weight rows (`spec.weaver_tree.fused_step_rows` runs a block as):

1. ``_rows_matmul_kernel`` (GATHER, NORM): x = token_table[token] (+ pos_emb), norm_attn(x) · W_qkvᵀ (its program
   0 also stores x, the block's residual);
2. ``_node_attention_kernel``: RoPE of q and k, the node's k/v written into the Weaver cache, attention over the
   prefix and the node's ancestors with an fp32 softmax;
3. ``_rows_matmul_kernel`` (RESIDUAL): x + attn · W_oᵀ;
4. ``_rows_matmul_kernel`` (NORM, SWIGLU or GELU): act(norm_mlp(x) · W_upᵀ + b);
5. ``_rows_matmul_kernel`` (RESIDUAL): x + act · W_downᵀ + b.

The output norm runs inside the pool re-scoring (``weaver_round.rescore_pool``). Numerics follow the torch
step: fp32 accumulation and norm statistics, every intermediate rounded to the Weaver dtype where the torch ops
round it. Twin: ``Weaver.step`` (without its ``out_norm``). Precondition of the fused attention: no node of a call
is an ancestor of another node of the same call — true of a tree round, whose nodes are children of nodes expanded
in earlier rounds — so each node reads its ancestors' K/V from the cache and its own from registers.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dflash_tfm.tuning import TunedChoice

MAX_ROWS = 16  # the row tile of the tensor-core dot
NO_ACT, SWIGLU, GELU = 0, 1, 2


@triton.jit
def _input_tile(x, row_base, pos_base, mm, k0, K, POS: tl.constexpr, BK: tl.constexpr):
    """Input rows at columns k0 … k0 + BK as fp32 (row r starts at element row_base[r] of x; POS adds the row at
    pointer pos_base[r], rounded as the torch add is), the column offsets and their mask."""
    offs_k = k0 + tl.arange(0, BK)
    km = offs_k < K
    mask = mm[:, None] & km[None, :]
    a = tl.load(x + row_base[:, None] + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
    if POS:
        a += tl.load(pos_base[:, None] + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        a = a.to(x.dtype.element_ty).to(tl.float32)
    return a, offs_k, km


@triton.jit
def _rows_matmul_kernel(
    x, res, x_out, tokens, nodes, depths, pos_emb, norm_w, norm_b, w, bias, y, partial, arrivals,
    M, N, K, KPOS, K_SPLIT, eps,
    GATHER: tl.constexpr, POS: tl.constexpr, NORM: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
    RESIDUAL: tl.constexpr, PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """Grid (cdiv(N, BN), SPLIT): y [M, N] = act(norm(rows) · wᵀ + bias) (+ res [M, N]).

    rows [M, K]: x itself, or (GATHER) the table x at row tokens[nodes[r]] (+ pos_emb[min(depths[nodes[r]],
    KPOS − 1)]), which program (0, 0) also writes to x_out. w [N, K] row-major, or (SWIGLU) [2N, K] = gate rows
    then up rows, y = silu(gate) · up.

    SPLIT > 1 splits K into slices of K_SPLIT (more programs keep more weight bytes in flight: a round's
    projections have ≤ 16 rows, so one program per N tile leaves the H200 at ~1.5 TB/s). Each program stores
    its fp32 partial sums to ``partial [SPLIT, 2, M, N]`` and counts itself in ``arrivals [cdiv(N, BN)]``
    (int32, zero between launches); the last program of a tile adds the partials in slice order (the result
    does not depend on which program came last), runs the epilogue and zeroes its counter again."""
    pid = tl.program_id(0)
    sid = tl.program_id(1)
    offs_m = tl.arange(0, BM)
    mm = offs_m < M
    row_base = offs_m.to(tl.int64) * K
    pos_base = pos_emb + row_base  # unused unless POS
    if GATHER:
        slot = tl.load(nodes + offs_m, mask=mm, other=0)
        row_base = tl.load(tokens + slot, mask=mm, other=0).to(tl.int64) * K
        if POS:
            pos_base = pos_emb + tl.minimum(tl.load(depths + slot, mask=mm, other=0), KPOS - 1).to(tl.int64) * K
    r = tl.zeros([BM], dtype=tl.float32)
    if NORM:  # statistics of every row over all K (rows are tiny next to the weight tile each program streams)
        sq = tl.zeros([BM], dtype=tl.float32)
        for k0 in range(0, K, BK):
            a, offs_k, km = _input_tile(x, row_base, pos_base, mm, k0, K, POS, BK)
            sq += tl.sum(a * a, axis=1)
            if GATHER:
                if (pid == 0) & (sid == 0):
                    tl.store(x_out + offs_m[:, None] * K + offs_k[None, :], a.to(x_out.dtype.element_ty),
                             mask=mm[:, None] & km[None, :])
        r = tl.rsqrt(sq / K + eps)
    offs_n = pid * BN + tl.arange(0, BN)
    nm = offs_n < N
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    acc_up = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(sid * K_SPLIT, tl.minimum(sid * K_SPLIT + K_SPLIT, K), BK):
        a, offs_k, km = _input_tile(x, row_base, pos_base, mm, k0, K, POS, BK)
        if NORM:  # WeaverNorm: (x · r) · weight + bias in fp32, then the Weaver dtype
            g = tl.load(norm_w + offs_k, mask=km, other=0.0).to(tl.float32)
            b = tl.load(norm_b + offs_k, mask=km, other=0.0).to(tl.float32)
            a = a * r[:, None] * g[None, :] + b[None, :]
        a = a.to(w.dtype.element_ty)
        wmask = nm[None, :] & km[:, None]
        acc += tl.dot(a, tl.load(w + offs_n[None, :] * K + offs_k[:, None], mask=wmask, other=0.0),
                      input_precision=PRECISION)
        if ACT == 1:
            acc_up += tl.dot(a, tl.load(w + (N + offs_n)[None, :] * K + offs_k[:, None], mask=wmask, other=0.0),
                             input_precision=PRECISION)
    if SPLIT == 1:
        _rows_epilogue(acc, acc_up, res, bias, y, offs_m, offs_n, mm, nm, N, ACT, HAS_BIAS, RESIDUAL)
    else:
        omask = mm[:, None] & nm[None, :]
        tile = offs_m[:, None] * N + offs_n[None, :]
        tl.store(partial + (2 * sid) * M * N + tile, acc, mask=omask)
        if ACT == 1:
            tl.store(partial + (2 * sid + 1) * M * N + tile, acc_up, mask=omask)
        tl.debug_barrier()  # every thread's partials written before the (release) count
        if tl.atomic_add(arrivals + pid, 1) == SPLIT - 1:  # (acquire) the other slices' partials are visible
            acc = tl.zeros([BM, BN], dtype=tl.float32)
            acc_up = tl.zeros([BM, BN], dtype=tl.float32)
            for j in tl.static_range(SPLIT):  # slice order: deterministic
                acc += tl.load(partial + (2 * j) * M * N + tile, mask=omask, other=0.0, cache_modifier=".cg")
                if ACT == 1:
                    acc_up += tl.load(partial + (2 * j + 1) * M * N + tile, mask=omask, other=0.0,
                                      cache_modifier=".cg")
            _rows_epilogue(acc, acc_up, res, bias, y, offs_m, offs_n, mm, nm, N, ACT, HAS_BIAS, RESIDUAL)
            tl.store(arrivals + pid, 0)


@triton.jit
def _rows_epilogue(acc, acc_up, res, bias, y, offs_m, offs_n, mm, nm, N, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
                   RESIDUAL: tl.constexpr):
    """y = act(acc + bias) (+ res) for the [BM, BN] tile of fp32 sums (acc_up: SwiGLU's up half)."""
    if HAS_BIAS:
        acc += tl.load(bias + offs_n, mask=nm, other=0.0).to(tl.float32)[None, :]
        if ACT == 1:
            acc_up += tl.load(bias + N + offs_n, mask=nm, other=0.0).to(tl.float32)[None, :]
    dtype = y.dtype.element_ty
    out = acc.to(dtype).to(tl.float32)  # the projection's output tensor
    if ACT == 1:  # F.silu(gate) * up: silu rounds, the product rounds
        out = (out * tl.sigmoid(out)).to(dtype).to(tl.float32) * acc_up.to(dtype).to(tl.float32)
    if ACT == 2:  # erf GELU
        out = 0.5 * out * (1.0 + tl.math.erf(out * 0.7071067811865476))
    omask = mm[:, None] & nm[None, :]
    if RESIDUAL:
        out = out.to(dtype).to(tl.float32) + tl.load(res + offs_m[:, None] * N + offs_n[None, :], mask=omask,
                                                     other=0.0).to(tl.float32)
    tl.store(y + offs_m[:, None] * N + offs_n[None, :], out.to(dtype), mask=omask)


@triton.jit
def _rotate_half(x1, x2, c1, c2, s1, s2, dtype):
    """Rotate-half RoPE of one head (halves x1, x2) in fp32, rounded to ``dtype`` as the torch step does."""
    return (x1 * c1 - x2 * s1).to(dtype).to(tl.float32), (x2 * c2 + x1 * s2).to(dtype).to(tl.float32)


@triton.jit
def _node_attention_kernel(
    qkv, cache_k, cache_v, cos, sin, nodes, depths, ancestors, out, P, NSLOTS, H, KPOS, scale,
    ROTARY: tl.constexpr, D: tl.constexpr, BT: tl.constexpr,
):
    """Program (node row i, head h). qkv [W, 3·H·D] (q | k | v); cache_k / cache_v [P + NSLOTS, H, D] (this layer);
    cos / sin [KPOS + 2, D] fp32; ancestors [NSLOTS, NSLOTS] uint8 (inclusive); out [W, H·D]."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    dtype = out.dtype.element_ty
    slot = tl.load(nodes + i)
    width = H * D
    base = i * 3 * width + h * D
    o1 = tl.arange(0, D // 2)
    o2 = D // 2 + o1
    q1 = tl.load(qkv + base + o1).to(tl.float32)
    q2 = tl.load(qkv + base + o2).to(tl.float32)
    k1 = tl.load(qkv + base + width + o1).to(tl.float32)
    k2 = tl.load(qkv + base + width + o2).to(tl.float32)
    v = tl.load(qkv + base + 2 * width + tl.arange(0, D)).to(tl.float32)
    if ROTARY:  # position min(depth, K) + 1 (the prefix holds 0 … K)
        pos = (tl.minimum(tl.load(depths + slot), KPOS) + 1) * D
        c1 = tl.load(cos + pos + o1)
        c2 = tl.load(cos + pos + o2)
        s1 = tl.load(sin + pos + o1)
        s2 = tl.load(sin + pos + o2)
        q1, q2 = _rotate_half(q1, q2, c1, c2, s1, s2, dtype)
        k1, k2 = _rotate_half(k1, k2, c1, c2, s1, s2, dtype)
    row = P + slot
    tl.store(cache_k + (row * H + h) * D + o1, k1.to(dtype))
    tl.store(cache_k + (row * H + h) * D + o2, k2.to(dtype))
    tl.store(cache_v + (row * H + h) * D + tl.arange(0, D), v.to(dtype))
    # Keys: the prefix, then the node's ancestors read from the cache (itself from registers: its row is being
    # written by this program); masked rows are never loaded. Two passes over key blocks of BT: the softmax
    # statistics, then the probabilities (rounded to the value dtype, as the torch step casts them) times V.
    s_self = (tl.sum(k1 * q1, axis=0) + tl.sum(k2 * q2, axis=0)) * scale
    m = s_self
    denom = tl.exp(s_self - m)  # 1: the node's own key (an fp32 tensor, as the loop carries it)
    for t0 in range(0, P + NSLOTS, BT):
        s, visible, key = _key_scores(cache_k, ancestors, q1, q2, o1, o2, slot, row, t0, P, NSLOTS, H, h, D, scale, BT)
        m_new = tl.maximum(m, tl.max(s, axis=0))
        denom = denom * tl.exp(m - m_new) + tl.sum(tl.where(visible, tl.exp(s - m_new), 0.0), axis=0)
        m = m_new
    o = (tl.exp(s_self - m) / denom).to(dtype).to(tl.float32) * v
    for t0 in range(0, P + NSLOTS, BT):
        s, visible, key = _key_scores(cache_k, ancestors, q1, q2, o1, o2, slot, row, t0, P, NSLOTS, H, h, D, scale, BT)
        p = tl.where(visible, tl.exp(s - m) / denom, 0.0).to(dtype).to(tl.float32)
        vc = tl.load(cache_v + key + tl.arange(0, D)[None, :], mask=visible[:, None], other=0.0).to(tl.float32)
        o += tl.sum(p[:, None] * vc, axis=0)
    tl.store(out + i * width + h * D + tl.arange(0, D), o.to(dtype))


@triton.jit
def _key_scores(cache_k, ancestors, q1, q2, o1, o2, slot, row, t0, P, NSLOTS, H, h, D: tl.constexpr, scale,
                BT: tl.constexpr):
    """Scores q·k·scale of cache rows t0 … t0 + BT (−inf where not visible: beyond the rows, not an ancestor, or
    the node itself), the visibility mask and the rows' element offsets."""
    offs_t = t0 + tl.arange(0, BT)
    in_slots = (offs_t >= P) & (offs_t < P + NSLOTS)
    anc = tl.load(ancestors + slot * NSLOTS + (offs_t - P), mask=in_slots, other=0)
    visible = (offs_t < P) | ((anc != 0) & (offs_t != row))
    key = (offs_t[:, None] * H + h) * D
    kc1 = tl.load(cache_k + key + o1[None, :], mask=visible[:, None], other=0.0).to(tl.float32)
    kc2 = tl.load(cache_k + key + o2[None, :], mask=visible[:, None], other=0.0).to(tl.float32)
    s = (tl.sum(kc1 * q1[None, :], axis=1) + tl.sum(kc2 * q2[None, :], axis=1)) * scale
    return tl.where(visible, s, -float("inf")), visible, key


def _block_n(n: int) -> int:
    return 16 if n <= 2048 else 32  # enough programs to keep the weight stream in flight


# Tiles (BN, BK, warps, stages, K slices) of `_rows_matmul_kernel`, a tuned choice per projection shape
# (`dflash_tfm.tuning`). The default tiles (one program per 16 or 32 columns, BK 128) streamed the Weaver's 59 MB
# per round at ~0.8 TB/s on the H200, cuBLAS the same projections at ~1.5 TB/s: wider K steps, more
# stages, and K split over several programs keep more weight bytes in flight. Of the ten tiles timed, each
# projection took one of these three in every recorded run (docs/data/perf/spec_step_h200_2026-12-03*.json): the normed qkv
# "n32 k256 s4" (12.8–14.3 µs), o_proj and down "n32 k128 s4 x4" (4.5–5.2 µs), the normed SwiGLU gate_up
# "n32 k64 s4 x8" (9.8–10.9 µs).
ROW_TILES = {"default": None, "n32 k256 s4": (32, 256, 4, 4, 1), "n32 k128 s4 x4": (32, 128, 4, 4, 4),
             "n32 k64 s4 x8": (32, 64, 4, 4, 8)}
ROWS_MATMUL = TunedChoice("weaver_rows_matmul", default="default", candidates=tuple(ROW_TILES))
_arrivals: dict[torch.device, torch.Tensor] = {}  # per device: the split tiles' counters, zero between launches
MAX_TILES = 4096


def _arrival_counters(device: torch.device) -> torch.Tensor:
    """The zeroed int32 counters the K-split launches share (each launch leaves them zero; launches on one
    stream run one after another). Made on the first (eager) call: a buffer first made inside a CUDA-graph
    capture would belong to that graph's memory pool."""
    if device not in _arrivals:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the K-split Weaver projections must run once outside a CUDA graph capture first")
        _arrivals[device] = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
    return _arrivals[device]


def rows_matmul(
    x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, *,
    norm: tuple[torch.Tensor, torch.Tensor, float] | None = None, bias: torch.Tensor | None = None,
    act: int = NO_ACT, res: torch.Tensor | None = None,
    gather: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor] | None = None,
) -> None:
    """y ← act(norm(rows) · weightᵀ + bias) (+ res), ``norm`` = (weight, bias, eps) of a Weaver RMSNorm (fp32
    statistics and affine). ``gather`` = (tokens, nodes, depths, pos_emb or None, x_out): the rows are
    x[tokens[nodes]] (+ pos_emb), stored to x_out."""
    M, N = y.shape
    K = weight.shape[1]
    tokens, nodes, depths, pos_emb, x_out = gather if gather is not None else (y, y, y, None, y)
    norm_weight, norm_bias, eps = norm if norm is not None else (weight, weight, 0.0)
    dummy = weight
    flags = dict(GATHER=gather is not None, POS=pos_emb is not None, NORM=norm is not None, ACT=act,
                 HAS_BIAS=bias is not None, RESIDUAL=res is not None)

    def launch(tile: str) -> None:
        BN, BK, warps, stages, split = ROW_TILES[tile] or (_block_n(N), 128, 4, 3, 1)
        k_split = triton.cdiv(K, split)
        BK = max(16, min(BK, triton.next_power_of_2(k_split)))  # (tl.dot needs K steps of >= 16)
        k_split = triton.cdiv(k_split, BK) * BK  # whole BK steps per slice
        tiles = triton.cdiv(N, BN)
        if split > 1 and tiles > MAX_TILES:
            raise ValueError(f"a K-split projection takes at most {MAX_TILES} tiles of {BN} columns, got N = {N}")
        partial = y.new_empty(split, 2, M, N, dtype=torch.float32) if split > 1 else dummy
        arrivals = _arrival_counters(y.device) if split > 1 else dummy
        _rows_matmul_kernel[(tiles, split)](
            x, res if res is not None else dummy, x_out, tokens, nodes, depths,
            pos_emb if pos_emb is not None else dummy, norm_weight, norm_bias, weight,
            bias if bias is not None else dummy, y, partial, arrivals, M, N, K,
            pos_emb.shape[0] if pos_emb is not None else 1, k_split, eps, **flags,
            PRECISION="ieee" if weight.dtype == torch.float32 else "tf32",
            BM=MAX_ROWS, BN=BN, BK=BK, SPLIT=split, num_warps=warps, num_stages=stages)

    if not (y.is_cuda and torch.cuda.is_current_stream_capturing()):
        _arrival_counters(y.device)  # now: the choice below times its candidates inside CUDA graphs
    # Every launch writes fresh outputs from unchanged inputs (x_out gets the same rows), so timing may repeat it.
    key = (M, N, K, weight.dtype, *flags.values())
    launch(ROWS_MATMUL.pick(key, lambda: {t: (lambda t=t: launch(t)) for t in ROW_TILES}, weight.device))


def node_attention(
    qkv: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
    nodes: torch.Tensor, depths: torch.Tensor, ancestors: torch.Tensor, out: torch.Tensor, prefix_len: int,
    max_depth: int,
) -> None:
    """out [W, H·D] ← attention of node slots ``nodes`` [W] (their q | k | v rows ``qkv [W, 3·H·D]``) over one
    layer's cache ``cache_k``, ``cache_v`` [P + N, H, D]: the prefix and each node's ancestors (``ancestors``
    [N, N] bool, inclusive), its own k, v written into the cache first; q, k RoPE'd at position
    min(depth, max_depth) + 1 when ``rope`` = (cos, sin) [max_depth + 2, D] fp32 is given."""
    H, D = cache_k.shape[1:]
    cos, sin = rope if rope is not None else (qkv, qkv)  # (not read without RoPE)
    _node_attention_kernel[(nodes.shape[0], H)](
        qkv, cache_k, cache_v, cos, sin, nodes, depths, ancestors.view(torch.uint8), out, prefix_len,
        ancestors.shape[0], H, max_depth, D ** -0.5, ROTARY=rope is not None, D=D, BT=32, num_warps=4)
