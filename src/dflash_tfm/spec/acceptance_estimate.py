"""Expected accepted drafts for every candidate proposal size, from the drafter's marginals alone.

A proposal node is accepted when the target's draws agree with every token on its path. If the drafter's
marginal at each depth were the target's distribution there, that would happen with the node's path
probability (the product of the marginals along its path), so a proposal's expected accepted drafts is the sum
of its nodes' path probabilities. For the best-first tree of b nodes (DDTREE's tree: `best_first`) that is the
sum of the b largest path probabilities; for a chain of b drafts (DFLASH's), the sum of the first b prefix
products of the top-1 probabilities. Both are known once the draft is, before any tree is built, for every size
at once, so the engine can pick the size to build (`engine.budget`), calibrating these drafter-side estimates
against the acceptance it then observes (drafters are over- or under-confident, and Weaver's trees accept more
than the marginals' best-first tree).
"""
from __future__ import annotations

import torch

from dflash_tfm.spec.ddtree import best_first


def expected_accepted_by_size(logits: torch.Tensor, sizes: list[tuple[str, int]]) -> torch.Tensor:
    """logits [K, V] of one draft -> fp32 [len(sizes)]: for each (kind, b), kind "chain" or "tree", the expected
    accepted drafts of that proposal of b nodes below the root (b = 0: none). No host sync, static shapes."""
    probs = logits.float().softmax(-1)
    chain = probs.amax(-1).cumprod(0).cumsum(0)  # [K]: E(chain of d drafts) at d - 1
    tree_max = max((b for kind, b in sizes if kind == "tree"), default=0)
    tree = best_first(logits, tree_max)[0].exp().cumsum(0) if tree_max else chain[:0]
    zero = chain.new_zeros(1)
    picks = [zero if b == 0 else (chain if kind == "chain" else tree)[b - 1 : b] for kind, b in sizes]
    return torch.cat(picks)
