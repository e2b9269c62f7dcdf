"""Drafter-side acceptance estimates: brute-force sums of path probabilities over the paths that leave the top-1
chain at most once, a lower bound on the exact best-first tree's."""
from __future__ import annotations

import itertools

import pytest
import torch

from dflash_tfm.spec.acceptance_estimate import expected_accepted_by_size
from dflash_tfm.spec.ddtree import best_first


def one_departure_path_probabilities(probs: torch.Tensor) -> list[float]:
    """Every path over the marginals probs [K, V] (depth 1..K) that differs from the top-1 chain in at most one
    depth: its probability."""
    K, V = probs.shape
    top = probs.argmax(-1).tolist()
    out = []
    for depth in range(1, K + 1):
        for path in itertools.product(range(V), repeat=depth):
            if sum(t != top[d] for d, t in enumerate(path)) <= 1:
                out.append(float(torch.prod(probs[torch.arange(depth), torch.tensor(path)])))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_estimates_match_brute_force(seed: int) -> None:
    torch.manual_seed(seed)
    K, V = 3, 4
    logits = torch.randn(K, V) * 2
    probs = logits.softmax(-1)
    best = sorted(one_departure_path_probabilities(probs), reverse=True)
    top1 = probs.amax(-1)
    sizes = [("chain", 0), ("chain", 1), ("chain", 3), ("tree", 1), ("tree", 5), ("tree", 20)]
    got = expected_accepted_by_size(logits, sizes, children=V)
    want = [0.0, float(top1[0]), float(top1[0] + top1[0] * top1[1] + top1.prod()), best[0], sum(best[:5]),
            sum(best[:20])]  # 21 such paths: 4 + 7 + 10 by depth
    assert torch.allclose(got, torch.tensor(want), atol=1e-5), (got, want)


def test_confident_drafts_expect_more() -> None:
    sharp, flat = torch.zeros(15, 50), torch.zeros(15, 50)
    sharp[:, 3] = 8.0
    sizes = [("chain", 15), ("tree", 64)]
    assert (expected_accepted_by_size(sharp, sizes) > 5 * expected_accepted_by_size(flat, sizes)).all()


@pytest.mark.parametrize("seed", range(4))
def test_the_estimates_bound_the_exact_best_first_sums(seed: int) -> None:
    """The tree sums never exceed the exact best-first tree's, and equal them for a drafter sure of one token per
    depth but for a runner-up (the best-first tree then leaves the chain at most once per path)."""
    gen = torch.Generator().manual_seed(seed)
    K, V, sizes = 15, 300, [("tree", b) for b in (8, 16, 32, 64, 128)]
    logits = torch.randn(K, V, generator=gen) * 3
    exact = best_first(logits, 128)[0].exp().cumsum(0)
    got = expected_accepted_by_size(logits, sizes)
    assert (got <= exact[[b - 1 for _, b in sizes]] + 1e-5).all()
    sure = torch.full((K, V), -40.0)
    sure[:, 0] = 6.0 + torch.rand(K, generator=gen)
    sure[:, 1] = 2.0 * torch.rand(K, generator=gen)
    exact = best_first(sure, 128)[0].exp().cumsum(0)
    small = [("tree", b) for b in (8, 16)]
    assert torch.allclose(expected_accepted_by_size(sure, small), exact[[b - 1 for _, b in small]], rtol=1e-4)


def test_a_batch_of_drafts_gives_each_draft_s_estimates() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 6, 40) * 2
    sizes = [("chain", 0), ("chain", 3), ("tree", 8), ("tree", 32)]
    batched = expected_accepted_by_size(logits, sizes)
    assert batched.shape == (3, len(sizes))
    for r in range(3):
        assert torch.allclose(batched[r], expected_accepted_by_size(logits[r], sizes), rtol=1e-6)
