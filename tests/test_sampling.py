"""The sampler's distribution transforms, checked against direct computations."""
from __future__ import annotations

import torch

from dflash_tfm import SamplingParams
from dflash_tfm.sampling import processed_probs, sample


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


def test_tiny_temperatures_and_top_p_are_greedy_and_ranges_are_checked() -> None:
    from dflash_tfm.sampling_params import MAX_TEMPERATURE, SAMPLING_EPS

    for settings in (dict(temperature=1e-37), dict(temperature=1e-40), dict(temperature=1.0, top_p=1e-46),
                     dict(temperature=0.7, top_k=1)):
        assert SamplingParams(**settings).greedy
    assert not SamplingParams(temperature=2 * SAMPLING_EPS).greedy
    for bad, field in ((dict(temperature=MAX_TEMPERATURE * 2), "temperature"), (dict(temperature=float("inf")), "temperature"),
                       (dict(temperature=float("nan")), "temperature"), (dict(temperature=True), "temperature"),
                       (dict(top_p=0.0), "top_p"), (dict(top_p=float("nan")), "top_p"), (dict(top_k=-2), "top_k")):
        try:
            SamplingParams(**bad)
        except ValueError as e:
            assert str(e).startswith(field), e
        else:
            raise AssertionError(f"{bad} was accepted")


def test_smallest_sampling_temperature_gives_finite_probabilities() -> None:
    """Just above the greedy threshold, with logits far apart, the distribution is finite and one-hot-ish."""
    from dflash_tfm.sampling_params import SAMPLING_EPS

    logits = torch.tensor([[30.0, -30.0, 29.9999, 1e4]])
    p = processed_probs(logits, SamplingParams(temperature=1.01 * SAMPLING_EPS, top_p=0.9, top_k=3))
    assert torch.isfinite(p).all() and torch.allclose(p.sum(-1), torch.ones(1))
    assert p.argmax(-1).item() == 3
