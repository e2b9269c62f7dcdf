"""Expected accepted drafts for every candidate proposal size, from the drafter's marginals alone.

A proposal node is accepted when the target's draws agree with every token on its path. If the drafter's
marginal at each depth were the target's distribution there, that would happen with the node's path
probability (the product of the marginals along its path), so a proposal's expected accepted drafts is the sum
of its nodes' path probabilities. For a tree of b nodes grown best-first (DDTREE's tree, and what Weaver's trees
approach) that is the sum of the b largest path probabilities; for a chain of b drafts (DFLASH's), the sum of the
first b prefix products of the top-1 probabilities. Both are known once the draft is, before any tree is built,
for every size at once, so the engine can pick the size to build (`engine.budget`), calibrating these drafter-side
estimates against the acceptance it then observes (drafters are over- or under-confident, and Weaver's trees
accept more than the marginals' best-first tree).

The estimate runs inside every draft's graph, so it must be cheap next to the draft itself: the tree sums come
from a beam of the b best paths per depth over each node's `ESTIMATE_CHILDREN` most probable continuations, found
with `topk` (values only: no tree structure, no stable ordering). Exact sorting over every child
(`ddtree.best_first`) cost about 1.1 ms per draft at b = 128 on an H100 with the SmolLM2 bundle, five times the
draft, and made every tree step look too dear to take. Leaving out the lower-ranked children can only drop
nodes, so the sums are at most the exact ones and equal them when no node the best-first tree would take is a
lower-ranked child; the calibration absorbs the rest.
"""
from __future__ import annotations

import torch

ESTIMATE_CHILDREN = 8


def expected_accepted_by_size(logits: torch.Tensor, sizes: list[tuple[str, int]],
                              children: int = ESTIMATE_CHILDREN) -> torch.Tensor:
    """logits [K, V] of one draft -> fp32 [len(sizes)]: for each (kind, b), kind "chain" or "tree", the expected
    accepted drafts of that proposal of b nodes below the root (b = 0: none). No host sync, static shapes."""
    logp = logits.float().log_softmax(-1)
    chain = logp.amax(-1).cumsum(0).exp().cumsum(0)  # [K]: E(chain of d drafts) at d - 1
    tree_max = max((b for kind, b in sizes if kind == "tree"), default=0)
    tree = best_path_probabilities(logp, tree_max, children).cumsum(0) if tree_max else chain[:0]
    zero = chain.new_zeros(1)
    picks = [zero if b == 0 else (chain if kind == "chain" else tree)[b - 1 : b] for kind, b in sizes]
    return torch.cat(picks)


def best_path_probabilities(logp: torch.Tensor, count: int, children: int) -> torch.Tensor:
    """log-marginals [K, V] -> the `count` largest path probabilities [count], decreasing, over the tree whose
    nodes continue with their `children` most probable tokens (zeros where that tree has fewer nodes)."""
    ranked = logp.topk(min(children, logp.shape[-1]), dim=-1).values  # [K, r]
    beam = ranked[0]
    depths = [beam]
    for d in range(1, logp.shape[0]):
        candidates = (beam[:, None] + ranked[d]).reshape(-1)
        beam = candidates.topk(min(count, candidates.numel())).values
        depths.append(beam)
    scores = torch.cat(depths)
    best = scores.topk(min(count, scores.numel())).values.exp()
    return torch.cat((best, best.new_zeros(count - best.numel())))
