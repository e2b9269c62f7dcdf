"""Drafter-side acceptance estimates: brute-force sums of path probabilities, exact while every node the best-first
tree takes is among its parent's most probable children, a lower bound otherwise."""
from __future__ import annotations

import itertools

import pytest
import torch

from dflash_tfm.spec.acceptance_estimate import expected_accepted_by_size
from dflash_tfm.spec.ddtree import best_first


def all_path_probabilities(probs: torch.Tensor) -> list[float]:
    """Every path of the full tree (depth 1..K) over the marginals probs [K, V]: its probability."""
    K, V = probs.shape
    out = []
    for depth in range(1, K + 1):
        for path in itertools.product(range(V), repeat=depth):
            out.append(float(torch.prod(probs[torch.arange(depth), torch.tensor(path)])))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_estimates_match_brute_force(seed: int) -> None:
    torch.manual_seed(seed)
    K, V = 3, 4
    logits = torch.randn(K, V) * 2
    probs = logits.softmax(-1)
    best = sorted(all_path_probabilities(probs), reverse=True)
    top1 = probs.amax(-1)
    sizes = [("chain", 0), ("chain", 1), ("chain", 3), ("tree", 1), ("tree", 5), ("tree", 20)]
    got = expected_accepted_by_size(logits, sizes, children=V)
    want = [0.0, float(top1[0]), float(top1[0] + top1[0] * top1[1] + top1.prod()), best[0], sum(best[:5]),
            sum(best[:20])]
    assert torch.allclose(got, torch.tensor(want), atol=1e-5), (got, want)


def test_confident_drafts_expect_more() -> None:
    sharp, flat = torch.zeros(15, 50), torch.zeros(15, 50)
    sharp[:, 3] = 8.0
    sizes = [("chain", 15), ("tree", 64)]
    assert (expected_accepted_by_size(sharp, sizes) > 5 * expected_accepted_by_size(flat, sizes)).all()


@pytest.mark.parametrize("seed", range(4))
def test_fewer_children_bound_the_exact_best_first_sums(seed: int) -> None:
    """With the default children per node, the tree sums never exceed the exact best-first tree's, and equal them
    when each depth's mass sits on fewer tokens than that (the rest of the vocabulary all but impossible)."""
    gen = torch.Generator().manual_seed(seed)
    K, V, sizes = 15, 300, [("tree", b) for b in (8, 16, 32, 64, 128)]
    logits = torch.randn(K, V, generator=gen) * 3  # flat-ish: lower-ranked children matter
    exact = best_first(logits, 128)[0].exp().cumsum(0)
    got = expected_accepted_by_size(logits, sizes)
    want = exact[[b - 1 for _, b in sizes]]
    assert (got <= want + 1e-5).all()
    peaked = torch.full((K, V), -40.0)
    peaked[:, :5] = torch.randn(K, 5, generator=gen) * 2
    exact = best_first(peaked, 128)[0].exp().cumsum(0)
    assert torch.allclose(expected_accepted_by_size(peaked, sizes), exact[[b - 1 for _, b in sizes]], rtol=1e-4)
