"""Drafter-side acceptance estimates equal brute-force sums of path probabilities."""
from __future__ import annotations

import itertools

import pytest
import torch

from dflash_tfm.spec.acceptance_estimate import expected_accepted_by_size


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
    got = expected_accepted_by_size(logits, sizes)
    want = [0.0, float(top1[0]), float(top1[0] + top1[0] * top1[1] + top1.prod()), best[0], sum(best[:5]),
            sum(best[:20])]
    assert torch.allclose(got, torch.tensor(want), atol=1e-5), (got, want)


def test_confident_drafts_expect_more() -> None:
    sharp, flat = torch.zeros(15, 50), torch.zeros(15, 50)
    sharp[:, 3] = 8.0
    sizes = [("chain", 15), ("tree", 64)]
    assert (expected_accepted_by_size(sharp, sizes) > 5 * expected_accepted_by_size(flat, sizes)).all()
