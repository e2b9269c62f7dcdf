"""DDTREE: the best-first proposal tree over the product of the DFlash marginals (no Weaver).

A node at depth d with path tokens x_1…x_d scores ``Σ_k log p_k(x_k)`` (log-softmax of the DFlash logits at
each depth); the children of a node are the tokens of depth d + 1 in rank order. The classic construction pops
the best entry of a heap holding, for every expanded node, its next-ranked sibling and its first child, until
``budget`` nodes hang below the root.

Because every log-probability is ≤ 0, a child never outscores its parent and a lower-ranked sibling never
outscores a higher-ranked one, so the popped set is exactly the ``budget`` best nodes of the whole (depth ≤ K)
tree, popped in decreasing score. We compute that set with K vectorised rounds instead of ``budget`` sequential
pops (fewer kernel launches when captured in a CUDA graph): at depth d only the ``budget`` best nodes of depth d
can be selected, and their parents are among the ``budget`` best of depth d − 1, so a beam of ``budget`` per
depth loses nothing; a final sort over all depths picks the winners in heap-pop order.

Ties (exactly equal scores) are broken by depth (shallower first) and then by a fixed order inside a depth
(parent's order, then sibling rank), which keeps parents before children. With continuous logits there are no
ties and the output equals the heap's pop order node for node.
"""
from __future__ import annotations

import torch

LOGPROB_FLOOR = -1e30  # −inf logits (masked vocab) become very unlikely but real candidates, never padding


def best_first(logits: torch.Tensor, budget: int) -> tuple[torch.Tensor, ...]:
    """The ``budget`` best nodes of the best-first tree over logits [..., K, V] (one tree per leading index: a
    batch's rows at once), in heap-pop order (see the module docstring): (score [..., budget] fp32 path
    log-probabilities, decreasing; depth0 [..., budget] = depth - 1; token ids [..., budget]; parent slot
    [..., budget] in this order, 0 = the root). No host sync, static shapes."""
    *lead, K, V = logits.shape
    device = logits.device
    if budget < 1 or sum(V**d for d in range(1, K + 1)) < budget:  # only V == 1 can run out of nodes
        raise ValueError(f"budget {budget} does not fit a tree of depth {K} over a vocabulary of {V}")
    rows = logits.reshape(-1, K, V)
    B = rows.shape[0]
    beam, ranks = budget, min(budget, V)  # at most `budget` nodes per depth and children per node
    logp, ids = rows.float().log_softmax(-1).clamp(min=LOGPROB_FLOOR).topk(ranks, dim=-1)  # [B, K, ranks]

    # Beam of the best `beam` nodes per depth, sorted (score desc, order of the previous depth, rank).
    score = torch.full((B, K, beam), float("-inf"), device=device)  # −inf = padding when a depth has fewer nodes
    parent = torch.zeros(B, K, beam, dtype=torch.long, device=device)  # position in the previous depth's beam
    rank = torch.zeros(B, K, beam, dtype=torch.long, device=device)
    score[:, 0, :ranks] = logp[:, 0]
    rank[:, 0, :ranks] = torch.arange(ranks, device=device)
    for d in range(1, K):
        cand = (score[:, d - 1, :, None] + logp[:, d, None, :]).reshape(B, -1)  # index = parent · ranks + rank
        top, idx = torch.sort(cand, dim=-1, descending=True, stable=True)
        score[:, d], parent[:, d], rank[:, d] = top[:, :beam], idx[:, :beam] // ranks, idx[:, :beam] % ranks

    # The best `budget` nodes over all depths; stable sort on the depth-major index breaks ties by depth.
    best, picked = torch.sort(score.reshape(B, -1), dim=-1, descending=True, stable=True)
    best, picked = best[:, :budget], picked[:, :budget]
    depth0 = picked // beam  # depth − 1; `picked` = depth0 · beam + position in that depth's beam
    slot_of = torch.zeros(B, K * beam, dtype=torch.long, device=device)  # output slot of every picked beam entry
    slot_of.scatter_(1, picked, torch.arange(1, budget + 1, device=device).expand(B, budget))
    up = slot_of.gather(1, (depth0 - 1).clamp(min=0) * beam + parent.reshape(B, -1).gather(1, picked))
    tokens = ids.reshape(B, -1).gather(1, depth0 * ranks + rank.reshape(B, -1).gather(1, picked))
    out = (best, depth0, tokens, torch.where(depth0 == 0, 0, up))
    return tuple(t.reshape(*lead, budget) for t in out)


def build_ddtree(
    root_token: torch.Tensor, logits: torch.Tensor, budget: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DDTREE over logits [..., K, V] (row k − 1 = depth k) with ``budget`` nodes below the root; with leading
    dims, one tree per index (root_token [...]: a batch's rows at once).

    Returns tokens, parents, depths ``[..., budget + 1]`` long (node 0 = root with parent −1, parents before
    children, distinct sibling tokens, depth ≤ K). No host sync and static shapes: CUDA-graph capturable.
    """
    _, depth0, ids, parents = best_first(logits, budget)
    lead = ids.shape[:-1]
    root = root_token.reshape(*lead, 1).to(device=logits.device, dtype=torch.long)
    minus_one = torch.full_like(root, -1)
    depths = torch.cat([torch.zeros_like(root), depth0 + 1], -1)
    return torch.cat([root, ids], -1), torch.cat([minus_one, parents], -1), depths
