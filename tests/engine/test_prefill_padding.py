"""Prompt chunks padded to a fixed multiple (what an attention-only target does on CUDA, so a few prefill shapes
serve every prompt length) leave everything a request reads as the exact-length prefill leaves it: the last
token's hidden state, the taps the drafter receives, the prompt's K/V, and the decode steps that follow (the
padding's K/V are overwritten before any query reads them)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from dflash_tfm.config import ModelConfig
from dflash_tfm.engine.model_runner import PREFILL_PAD, prefill_in_chunks, prefill_padding
from dflash_tfm.loading.loader import build_model
from dflash_tfm.models.cache import ModelCache
from dflash_tfm.models.random_init import init_random_
from tests.spec.test_speculative_decoding import TARGETS

CAPACITY = 160


def prefilled(model, cfg: ModelConfig, prompt: torch.Tensor, pad_to: int) -> tuple:
    """The prompt in chunks of 16 padded to multiples of `pad_to` -> (last hidden state, taps per chunk, cache)."""
    cache = ModelCache(cfg, CAPACITY, batch=1, dtype=torch.float32, device=torch.device("cpu"))
    taps: list[tuple[int, list[torch.Tensor]]] = []
    last = prefill_in_chunks(model, prompt, cache, 0, 16, tap_layers=(0, 2),
                             on_taps=lambda t, first: taps.append((first, t)), pad_to=pad_to)
    return last, taps, cache


def test_padded_chunks_leave_what_the_request_reads_unchanged() -> None:
    cfg = ModelConfig.from_dict(TARGETS["dense"])
    model = init_random_(build_model(cfg, torch.device("cpu"), torch.float32, max_positions=CAPACITY), seed=5)
    prompt = torch.randint(0, cfg.vocab_size, (37,), generator=torch.Generator().manual_seed(0))
    exact, padded = prefilled(model, cfg, prompt, 1), prefilled(model, cfg, prompt, PREFILL_PAD)
    assert torch.allclose(exact[0], padded[0], atol=1e-5)
    assert [first for first, _ in exact[1]] == [first for first, _ in padded[1]] == [0, 16, 32]
    for (_, a), (_, b) in zip(exact[1], padded[1]):
        assert all(x.shape == y.shape and torch.allclose(x, y, atol=1e-5) for x, y in zip(a, b))
    assert torch.allclose(exact[2].k[:, :, :37], padded[2].k[:, :, :37], atol=1e-5)
    assert not torch.equal(exact[2].k[:, :, 37:], padded[2].k[:, :, 37:])  # the padding did write beyond
    for position in range(37, 41):  # the decode steps after the prompt read the same keys
        token = torch.tensor([[position % cfg.vocab_size]])
        outs = [model(token, torch.tensor([[position]]), cache, kv_len=CAPACITY)[0] for cache in (exact[2],
                                                                                               padded[2])]
        assert torch.allclose(*outs, atol=1e-5)


def test_only_attention_only_targets_on_cuda_are_padded() -> None:
    """A Gated-DeltaNet layer would fold padding tokens into its state; the CPU has no per-shape costs."""
    on_cuda = SimpleNamespace(is_cuda=True)
    dense, hybrid = (SimpleNamespace(config=ModelConfig.from_dict(TARGETS[k])) for k in ("dense", "hybrid"))
    assert prefill_padding(dense, on_cuda) == PREFILL_PAD
    assert prefill_padding(hybrid, on_cuda) == 1
    assert prefill_padding(dense, torch.zeros(1)) == 1
