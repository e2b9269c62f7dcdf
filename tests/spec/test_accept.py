"""The vectorised acceptance walk against a plain Python walk of the tree."""
from __future__ import annotations

import pytest
import torch

from dflash_tfm.spec.accept import accept_tree
from dflash_tfm.tree import TreeSpec, random_parents


def python_walk(tokens: list[int], parents: list[int], draws: list[int]) -> tuple[list[int], int]:
    node, path = 0, [0]
    while True:
        child = next((c for c in range(len(tokens)) if parents[c] == node and tokens[c] == draws[node]), None)
        if child is None:
            return path, draws[node]
        node = child
        path.append(node)


@pytest.mark.parametrize("shape", ["chain", "star", "binary", "random", "best_first"])
@pytest.mark.parametrize("seed", range(6))
def test_walk_matches_python(shape: str, seed: int) -> None:
    n, vocab, max_depth = (16 if shape == "chain" else 40), 6, 15
    gen = torch.Generator().manual_seed(seed)
    parents = random_parents(n, shape, seed=seed, max_depth=max_depth)
    # distinct sibling tokens: rank among siblings, shuffled per parent
    tokens = torch.zeros(n, dtype=torch.long)
    for p in set(parents.tolist()):
        kids = (parents == p).nonzero().flatten()
        tokens[kids] = torch.randperm(max(vocab, len(kids)), generator=gen)[: len(kids)]
    tree = TreeSpec.build(tokens, parents)
    assert int(tree.depths.max()) <= max_depth
    draws = torch.randint(0, vocab, (n,), generator=gen)
    # make acceptance likely: half the nodes draw their first child's token
    for i in range(n):
        kids = (parents == i).nonzero().flatten()
        if len(kids) and torch.rand(1, generator=gen) < 0.7:
            draws[i] = tokens[kids[0]]
    acc = accept_tree(tokens, parents, tree.depths, tree.ancestor_mask(), draws, max_depth)
    path, bonus = python_walk(tokens.tolist(), parents.tolist(), draws.tolist())
    assert [i for i in acc.path.tolist() if i >= 0] == path
    assert acc.accepted.nonzero().flatten().tolist() == sorted(path)
    assert int(acc.last) == path[-1] and int(acc.bonus) == bonus


def test_target_draws_invert_the_cdf_and_never_pick_a_masked_token() -> None:
    """u in [0, 1) maps to the token whose CDF interval holds u; u just below 1 still lands on a token with
    p > 0 when top-k masked the vocabulary's tail (the clamp against fp32 rounding of u·total)."""
    from dflash_tfm.sampling_params import SamplingParams
    from dflash_tfm.spec.accept import target_draws

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 5.0, 3.0]]).repeat(4, 1)
    params = SamplingParams(temperature=1.0, top_k=3)
    p = torch.softmax(torch.tensor([2.0, 5.0, 3.0]), 0)  # tokens 0, 4, 5 survive top-3
    cdf = torch.cumsum(torch.stack([p[0], torch.tensor(0.0), torch.tensor(0.0), torch.tensor(0.0), p[1], p[2]]), 0)
    uniforms = torch.tensor([0.0, float(cdf[0]) + 1e-4, float(cdf[4]) + 1e-4, 1 - 2**-24])
    assert target_draws(logits, params, uniforms).tolist() == [0, 4, 5, 5]
    greedy = target_draws(logits, SamplingParams(temperature=0.0), uniforms)
    assert greedy.tolist() == [4, 4, 4, 4]


def _tree_with_logits(seed: int, n: int = 24, vocab: int = 12) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    parents = random_parents(n, "random", seed=seed, max_depth=6)
    tokens = torch.zeros(n, dtype=torch.long)
    for p in set(parents.tolist()):
        kids = (parents == p).nonzero().flatten()
        tokens[kids] = torch.randperm(vocab, generator=gen)[: len(kids)]
    tree = TreeSpec.build(tokens, parents)
    logits = torch.randn(n, vocab, generator=gen)
    logits[parents[1:], tokens[1:]] += 2.0  # drafts the target likes: deep paths get accepted
    return tokens, parents, tree, logits


@pytest.mark.parametrize("seed", range(3))
def test_expected_accepted_matches_sampled_walks(seed: int) -> None:
    """The exact expectation equals the mean accepted count of many independent walks (within 4 standard
    errors), and at temperature 0 it is the one walk's accepted count."""
    from dflash_tfm.sampling_params import SamplingParams
    from dflash_tfm.spec.accept import expected_accepted, target_draws

    tokens, parents, tree, logits = _tree_with_logits(seed)
    ancestors = tree.ancestor_mask()
    params = SamplingParams(temperature=1.0, top_k=4)
    exact = float(expected_accepted(logits, tokens, parents, ancestors, params))
    gen = torch.Generator().manual_seed(100 + seed)
    counts = []
    for _ in range(4000):
        draws = target_draws(logits, params, torch.rand(len(tokens), generator=gen))
        counts.append(int(accept_tree(tokens, parents, tree.depths, ancestors, draws, 6).accepted.sum()) - 1)
    counts = torch.tensor(counts, dtype=torch.float64)
    assert exact > 0.1
    assert abs(counts.mean().item() - exact) < 4 * counts.std().item() / len(counts) ** 0.5
    greedy = SamplingParams(temperature=0.0)
    walk = accept_tree(tokens, parents, tree.depths, ancestors, target_draws(logits, greedy, torch.zeros(1)), 6)
    assert float(expected_accepted(logits, tokens, parents, ancestors, greedy)) == int(walk.accepted.sum()) - 1
