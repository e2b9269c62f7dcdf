"""A DFLASH_TFM tree round's bookkeeping as three Triton kernels: re-score the pools, publish children, place nodes.

A Weaver round is launch-bound (≤ 8 rows; see docs/PERFORMANCE.md): beside the Weaver step itself it spends
~20 small kernels on the pool-row gather of ``W_res``, its bmm, log-softmax, ``topk`` with its bitonic sort,
scoring, the frontier write, and in the next round on the frontier ``topk`` and five scattered writes. Here each
of the three jobs is one launch, reading and writing the tree's static buffers in place at the round's node
slots ``nodes [W]`` (read on the device: no host sync, capturable):

* :func:`rescore_pool`: ``pool_logit[d + 1] + (W_res[pool_id] · out_norm(x))`` for every node, the Weaver step's
  output norm applied on the way in, pool rows read by id (no gathered copy), the dot accumulated in fp32 and
  rounded to W_res's dtype as the twin's bmm output is;
* :func:`publish_children`: log-softmax over the pool, the best ``c`` children by repeated arg-max, scores
  ``parent + log p`` (−inf for nodes at depth K), written straight into the node's frontier row;
* :func:`place_nodes`: the best W frontier entries by repeated arg-max, written as tree nodes (token, parent,
  score, depth, ancestor row) and consumed.

Repeated arg-max takes the lowest index among exactly equal values; ``topk`` may return ties in either order
(the module docstring of ``spec.weaver_tree``: continuous scores have none). Twins: ``reference.py``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dflash_tfm.kernels import use_triton
from dflash_tfm.kernels.tree_growth import reference

LOGPROB_FLOOR = reference.LOGPROB_FLOOR
# Launch shapes, from the H200 timings of a budget-64 tree's rounds (docs/data/perf/spec_step_h200_2026-12-03*.json, four
# runs): re-scoring 16 pool rows per program with 4 warps (5.5–6.2 µs; 4, 8 or 32 rows were 3–20 % slower with
# the output norm fused in), publishing with 1 warp, whose 16 arg-max passes then need no cross-warp exchange
# through shared memory (5.5–5.8 µs against 9.1–9.8 with 4 warps).
RESCORE_POOL_ROWS, RESCORE_WARPS = 16, 4
PUBLISH_WARPS = 1


@triton.jit
def _rescore_pool_kernel(w_res, query, norm_w, norm_b, pool_ids, pool_logits, depths, nodes, out, P, D, K, eps,
                         BP: tl.constexpr, BD: tl.constexpr):
    """Program (node i, pool block). out [W, P] fp32. The query row is first put through the Weaver's output norm
    (fp32 statistics and affine, rounded to W_res's dtype)."""
    i = tl.program_id(0)
    offs_p = tl.program_id(1) * BP + tl.arange(0, BP)
    mask_p = offs_p < P
    row = tl.minimum(tl.load(depths + tl.load(nodes + i)), K - 1)
    ids = tl.load(pool_ids + row * P + offs_p, mask=mask_p, other=0)
    sq = tl.zeros([BD], dtype=tl.float32)
    for d0 in range(0, D, BD):
        offs_d = d0 + tl.arange(0, BD)
        q = tl.load(query + i * D + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
        sq += q * q
    r = tl.rsqrt(tl.sum(sq, axis=0) / D + eps)
    acc = tl.zeros([BP], dtype=tl.float32)
    for d0 in range(0, D, BD):
        offs_d = d0 + tl.arange(0, BD)
        mask_d = offs_d < D
        w = tl.load(w_res + ids[:, None].to(tl.int64) * D + offs_d[None, :],
                    mask=mask_p[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
        q = tl.load(query + i * D + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        g = tl.load(norm_w + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        b = tl.load(norm_b + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        q = (q * r * g + b).to(w_res.dtype.element_ty).to(tl.float32)
        acc += tl.sum(w * q[None, :], axis=1)
    residual = acc.to(w_res.dtype.element_ty).to(tl.float32)
    logit = tl.load(pool_logits + row * P + offs_p, mask=mask_p, other=0.0)
    tl.store(out + i * P + offs_p, logit + residual, mask=mask_p)


@triton.jit
def _publish_children_kernel(logits, pool_ids, depths, scores, frontier_score, frontier_token, nodes, P, K,
                             C: tl.constexpr, BP: tl.constexpr, FLOOR: tl.constexpr):
    """Program i = node nodes[i]; logits [W, P] fp32 (re-scored), frontier rows [n, C]."""
    i = tl.program_id(0)
    slot = tl.load(nodes + i)
    offs = tl.arange(0, BP)
    mask = offs < P
    x = tl.load(logits + i * P + offs, mask=mask, other=-float("inf"))
    m = tl.max(x, axis=0)
    lse = m + tl.log(tl.sum(tl.where(mask, tl.exp(x - m), 0.0), axis=0))
    logp = tl.where(mask, tl.maximum(x - lse, FLOOR), -float("inf"))
    depth = tl.load(depths + slot)
    row = tl.minimum(depth, K - 1)
    parent_score = tl.load(scores + slot)
    for r in tl.static_range(C):
        best = tl.max(logp, axis=0)
        pick = tl.argmax(logp, axis=0)
        score = tl.where(depth >= K, -float("inf"), parent_score + best)
        tl.store(frontier_score + slot * C + r, score)
        tl.store(frontier_token + slot * C + r, tl.load(pool_ids + row * P + pick))
        logp = tl.where(offs == pick, -float("inf"), logp)


@triton.jit
def _place_nodes_kernel(flat_score, flat_token, tokens, parents, depths, scores, ancestors, nodes, E, N,
                        W: tl.constexpr, C: tl.constexpr, BE: tl.constexpr, BN: tl.constexpr):
    """One program. flat_score / flat_token [E = N·C]; ancestors [N, N] as uint8."""
    offs_e = tl.arange(0, BE)
    s = tl.load(flat_score + offs_e, mask=offs_e < E, other=-float("inf"))
    offs_n = tl.arange(0, BN)
    mask_n = offs_n < N
    for i in tl.static_range(W):
        best = tl.max(s, axis=0)
        entry = tl.argmax(s, axis=0)
        s = tl.where(offs_e == entry, -float("inf"), s)
        slot = tl.load(nodes + i)
        parent = entry // C
        tl.store(tokens + slot, tl.load(flat_token + entry))
        tl.store(parents + slot, parent.to(tl.int64))
        tl.store(scores + slot, best)
        tl.store(depths + slot, tl.load(depths + parent) + 1)
        row = tl.load(ancestors + parent * N + offs_n, mask=mask_n, other=0)
        tl.store(ancestors + slot * N + offs_n, row | (offs_n == slot).to(tl.uint8), mask=mask_n)
        tl.store(flat_score + entry, -float("inf"))


def rescore_pool(w_res: torch.Tensor, rows: torch.Tensor, pool_ids: torch.Tensor, pool_logits: torch.Tensor,
                 depths: torch.Tensor, nodes: torch.Tensor, norm: tuple[torch.Tensor, torch.Tensor, float],
                 ) -> torch.Tensor:
    """Re-scored child logits ``[W, P]`` fp32 of node slots ``nodes [W]``: rows [W, D] are the Weaver step's last
    block outputs, put through its output norm ``norm`` = (weight, bias, eps) (`reference.weaver_norm`) to make
    the queries; pool_ids / pool_logits [K, P] (row d = candidates of depth d + 1); depths [n]."""
    W, D = rows.shape
    K, P = pool_ids.shape
    if not use_triton(rows):
        return reference.rescore_pool_reference(w_res, reference.weaver_norm(rows, *norm), pool_ids, pool_logits,
                                                depths, nodes)
    out = torch.empty(W, P, dtype=torch.float32, device=rows.device)
    weight, bias, eps = norm
    _rescore_pool_kernel[(W, triton.cdiv(P, RESCORE_POOL_ROWS))](
        w_res, rows.contiguous(), weight, bias, pool_ids, pool_logits, depths, nodes, out, P, D, K, eps,
        BP=RESCORE_POOL_ROWS, BD=min(256, triton.next_power_of_2(D)), num_warps=RESCORE_WARPS)
    return out


def publish_children(logits: torch.Tensor, pool_ids: torch.Tensor, depths: torch.Tensor, scores: torch.Tensor,
                     frontier_score: torch.Tensor, frontier_token: torch.Tensor, nodes: torch.Tensor) -> None:
    """Frontier rows ``nodes [W]`` ← each node's best ``c`` children (c = frontier width) from its
    re-scored pool ``logits [W, P]``: scores parent + log p (−inf for nodes at depth ≥ K), tokens from the pool."""
    if not use_triton(logits):
        reference.publish_children_reference(logits, pool_ids, depths, scores, frontier_score, frontier_token, nodes)
        return
    W, P = logits.shape
    _publish_children_kernel[(W,)](
        logits, pool_ids, depths, scores, frontier_score, frontier_token, nodes, P, pool_ids.shape[0],
        C=frontier_score.shape[1], BP=triton.next_power_of_2(P), FLOOR=LOGPROB_FLOOR, num_warps=PUBLISH_WARPS)


def place_nodes(flat_score: torch.Tensor, flat_token: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                depths: torch.Tensor, scores: torch.Tensor, ancestors: torch.Tensor, nodes: torch.Tensor,
                children: int) -> None:
    """Node slots ``nodes [W]`` ← the best W frontier entries (entry = parent · children + rank), best first,
    each consumed (−inf); ``check_fillable`` guarantees that many live entries."""
    if not use_triton(flat_score):
        reference.place_nodes_reference(flat_score, flat_token, tokens, parents, depths, scores, ancestors,
                                        nodes, children)
        return
    N = ancestors.shape[0]
    _place_nodes_kernel[(1,)](
        flat_score, flat_token, tokens, parents, depths, scores, ancestors.view(torch.uint8), nodes,
        flat_score.numel(), N, W=nodes.shape[0], C=children, BE=triton.next_power_of_2(flat_score.numel()),
        BN=triton.next_power_of_2(N), num_warps=4)
