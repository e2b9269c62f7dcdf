"""The sampler's distribution transforms, checked against direct computations."""
from __future__ import annotations

import torch

from dflash_tfm import SamplingParams
from dflash_tfm.engine.sampler import processed_probs, sample


def test_temperature_only_is_softmax() -> None:
    logits = torch.randn(3, 50)
    p = processed_probs(logits, SamplingParams(temperature=0.7))
    assert torch.allclose(p, torch.softmax(logits / 0.7, -1), atol=1e-6)


def test_top_k_keeps_k_tokens() -> None:
    logits = torch.randn(2, 100)
    p = processed_probs(logits, SamplingParams(temperature=1.0, top_k=5))
    assert ((p > 0).sum(-1) == 5).all()
    top = logits.topk(5, -1).indices
    assert torch.allclose(p.gather(-1, top), torch.softmax(logits.gather(-1, top), -1), atol=1e-6)


def test_top_p_keeps_smallest_prefix_reaching_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = processed_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]), atol=1e-6)
    p = processed_probs(logits, SamplingParams(temperature=1.0, top_p=0.81))
    assert torch.allclose(p, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95, atol=1e-6)


def test_greedy_and_top_k_one_agree() -> None:
    logits = torch.randn(4, 30)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(sample(logits, SamplingParams(), None), logits.argmax(-1))
    assert torch.equal(sample(logits, SamplingParams(temperature=1.0, top_k=1), g), logits.argmax(-1))


def test_sampling_frequencies_follow_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    g = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=1.0)
    draws = torch.stack([sample(logits, params, g) for _ in range(4000)]).flatten()
    freq = torch.bincount(draws, minlength=3).float() / draws.numel()
    assert torch.allclose(freq, torch.tensor([0.6, 0.3, 0.1]), atol=0.03)
