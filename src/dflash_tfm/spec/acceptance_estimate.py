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

The estimate runs inside every draft's graph, so it must be cheap next to the draft itself. The tree sums are
taken over the paths that leave the drafter's top-1 chain at most once (at some depth, to one of that depth's
`ESTIMATE_CHILDREN` most probable tokens other than the first) and then follow the chain: K x (children - 1) x K
candidates scored in a few broadcast operations and one `topk`, with no per-depth loop. A beam over every depth
(one `topk` per depth) cost about 0.43 ms per draft on an H100 with the SmolLM2 bundle, twice the draft itself.
Those paths form a prefix-closed subset of the full tree, so each sum is at most the exact best-first tree's
(`ddtree.best_first`) and equals it while the best-first tree leaves the chain at most once on every path, as it
mostly does when the drafter is confident; the calibration absorbs the rest.
"""
from __future__ import annotations

import torch

ESTIMATE_CHILDREN = 8


def expected_accepted_by_size(logits: torch.Tensor, sizes: list[tuple[str, int]],
                              children: int = ESTIMATE_CHILDREN) -> torch.Tensor:
    """logits [..., K, V] of one draft per leading index (a batch's rows at once) -> fp32 [..., len(sizes)]: for
    each (kind, b), kind "chain" or "tree", the expected accepted drafts of that proposal of b nodes below the
    root (b = 0: none). No host sync, static shapes."""
    logp = logits.float().log_softmax(-1)
    chain = logp.amax(-1).cumsum(-1).exp().cumsum(-1)  # [..., K]: E(chain of d drafts) at d - 1
    tree_max = max((b for kind, b in sizes if kind == "tree"), default=0)
    tree = best_path_probabilities(logp, tree_max, children).cumsum(-1) if tree_max else chain[..., :0]
    zero = chain.new_zeros(*chain.shape[:-1], 1)
    picks = [zero if b == 0 else (chain if kind == "chain" else tree)[..., b - 1 : b] for kind, b in sizes]
    return torch.cat(picks, dim=-1)


def best_path_probabilities(logp: torch.Tensor, count: int, children: int) -> torch.Tensor:
    """log-marginals [..., K, V] -> the `count` largest path probabilities [..., count], decreasing, over the
    paths that follow the top-1 chain, leave it at most once for one of a depth's `children` most probable
    tokens, and follow it again (zeros where there are fewer paths)."""
    K = logp.shape[-2]
    ranked = logp.topk(min(children, logp.shape[-1]), dim=-1).values  # [..., K, r]
    chain = ranked[..., 0].cumsum(-1)  # [..., K]: the chain to depth d
    before = torch.cat((chain.new_zeros(*chain.shape[:-1], 1), chain[..., :-1]), dim=-1)  # the chain above depth d
    depth = torch.arange(K, device=logp.device)
    rejoin = torch.where(depth[None, :] >= depth[:, None], chain[..., None, :] - chain[..., :, None],
                         float("-inf"))  # [..., d, e]
    leave = before[..., :, None] + ranked[..., 1:]  # [..., d, j]: leave the chain at depth d for its (j + 1)-th token
    ends = (leave[..., :, :, None] + rejoin[..., :, None, :]).flatten(-3)  # end at depth e >= d
    scores = torch.cat((chain, ends), dim=-1)
    best = scores.topk(min(count, scores.shape[-1]), dim=-1).values.exp()
    return torch.cat((best, best.new_zeros(*best.shape[:-1], count - best.shape[-1])), dim=-1)
