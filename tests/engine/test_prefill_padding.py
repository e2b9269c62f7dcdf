"""Prompt chunks padded to a fixed multiple (what an attention-only target does on CUDA, so a few prefill shapes
serve every prompt length) leave everything a request reads as the exact-length prefill leaves it: the last
token's hidden state, the taps the drafter receives, the prompt's K/V, and the decode steps that follow (the
padding's K/V are overwritten before any query reads them)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dflash_tfm import Engine
from dflash_tfm.config import ModelConfig
from dflash_tfm.engine import model_runner
from dflash_tfm.engine.model_runner import PREFILL_PAD, prefill_in_chunks, prefill_padding
from dflash_tfm.loading.loader import build_model
from dflash_tfm.models.cache import ModelCache
from dflash_tfm.models.random_init import init_random_
from tests.engine.test_continuous_batching import MAX_LEN, SLOTS, mixed_requests, run_batch, solo
from tests.engine.test_speculative_batch import tiny_speculative_setup
from tests.spec.test_speculative_decoding import TARGETS


def prefilled(model, cfg: ModelConfig, prompt: torch.Tensor, pad_to: int, capacity: int, start: int) -> tuple:
    """The prompt's first `start` tokens exactly, then the rest in chunks of 16 padded to multiples of `pad_to`
    (as far as the cache's `capacity` allows) -> (last hidden state, taps per chunk, cache)."""
    cache = ModelCache(cfg, capacity, batch=1, dtype=torch.float32, device=torch.device("cpu"))
    taps: list[tuple[int, list[torch.Tensor]]] = []
    if start:
        prefill_in_chunks(model, prompt[:start], cache, 0, 16, pad_to=1)
    last = prefill_in_chunks(model, prompt[start:], cache, start, 16, tap_layers=(0, 2),
                             on_taps=lambda t, first: taps.append((first, t)), pad_to=pad_to)
    return last, taps, cache


@pytest.mark.parametrize("capacity, start", [(160, 0), (160, 7), (44, 0)])  # 44: the last chunk's padding is cut
def test_padded_chunks_leave_what_the_request_reads_unchanged(capacity: int, start: int) -> None:
    cfg = ModelConfig.from_dict(TARGETS["dense"])
    model = init_random_(build_model(cfg, torch.device("cpu"), torch.float32, max_positions=160), seed=5)
    prompt = torch.randint(0, cfg.vocab_size, (37,), generator=torch.Generator().manual_seed(0))
    exact, padded = (prefilled(model, cfg, prompt, pad_to, capacity, start) for pad_to in (1, PREFILL_PAD))
    assert torch.allclose(exact[0], padded[0], atol=1e-5)
    assert [first for first, _ in exact[1]] == [first for first, _ in padded[1]] == list(range(start, 37, 16))
    for (_, a), (_, b) in zip(exact[1], padded[1]):
        assert all(x.shape == y.shape and torch.allclose(x, y, atol=1e-5) for x, y in zip(a, b))
    assert torch.allclose(exact[2].k[:, :, :37], padded[2].k[:, :, :37], atol=1e-5)
    assert not torch.equal(exact[2].k[:, :, 37:], padded[2].k[:, :, 37:])  # the padding did write beyond
    for position in range(37, 41):  # the decode steps after the prompt read the same keys
        token = torch.tensor([[position % cfg.vocab_size]])
        outs = [model(token, torch.tensor([[position]]), cache, kv_len=capacity)[0] for cache in (exact[2],
                                                                                               padded[2])]
        assert torch.allclose(*outs, atol=1e-5)


@pytest.mark.parametrize("algorithm", [None, "DDTREE"])
def test_engines_decode_the_same_tokens_from_padded_prompts(algorithm: str | None, tmp_path, monkeypatch) -> None:
    """The continuous batch (autoregressive or speculative) and a lone request, every prompt prefilled in chunks
    padded to multiples of 8 (the CPU's exact lengths otherwise): the same tokens as unpadded."""
    path, spec = tiny_speculative_setup(tmp_path, "llama", algorithm or "DDTREE")

    def outputs() -> tuple:
        engine = Engine(path, spec if algorithm else None, device="cpu", dtype="float32", max_model_len=MAX_LEN,
                        max_running_requests=SLOTS, progress=False)
        requests = mixed_requests(engine)
        return run_batch(engine, requests), solo(engine, *requests[3])

    exact = outputs()
    monkeypatch.setattr(model_runner, "prefill_padding", lambda model, token_ids: 8)
    assert outputs() == exact


def test_only_attention_only_targets_on_cuda_are_padded() -> None:
    """A Gated-DeltaNet layer would fold padding tokens into its state; the CPU has no per-shape costs."""
    on_cuda = SimpleNamespace(is_cuda=True)
    dense, hybrid = (SimpleNamespace(config=ModelConfig.from_dict(TARGETS[k])) for k in ("dense", "hybrid"))
    assert prefill_padding(dense, on_cuda) == PREFILL_PAD
    assert prefill_padding(hybrid, on_cuda) == 1
    assert prefill_padding(dense, torch.zeros(1)) == 1
