"""BatchGenerator: many prompts decoded together give, row for row, what decoding each prompt alone gives.

Oracle: `ModelRunner` prefill + step-by-step decode of one sequence (itself checked against transformers in
tests/models/test_parity.py). Tiny random hybrid (Gated DeltaNet + gated attention) and dense targets, fp32;
fewer slots than prompts, so rows are refilled mid-run at other rows' positions; prompts of different lengths;
one prompt that reaches the end of the cache rows.
"""
from __future__ import annotations

import pytest
import torch

from dflash_tfm.config import ModelConfig
from dflash_tfm.engine.batch_generation import BatchGenerator
from dflash_tfm.engine.model_runner import ModelRunner, key_length_bucket
from dflash_tfm.loading.loader import build_model, load_weights, open_checkpoint
from dflash_tfm.sampling_params import SamplingParams
from tests.models.tiny_targets import VOCAB, save_hf_model

MAX_LEN = 64


@pytest.fixture(scope="module", params=["qwen3_5_text", "llama"])
def model(request, tmp_path_factory):
    _, path = save_hf_model(request.param, tmp_path_factory.mktemp("ckpt"))
    source, raw, _ = open_checkpoint(path)
    cfg = ModelConfig.from_dict(raw)
    m = build_model(cfg, torch.device("cpu"), torch.float32, max_positions=MAX_LEN)
    load_weights(m, source, cfg, progress=False)
    return m


def greedy_alone(model, prompt: list[int], max_new: int, stop: set[int]) -> list[int]:
    runner = ModelRunner(model, MAX_LEN, torch.device("cpu"), use_cuda_graph=False)
    runner.reset()
    logits, _ = runner.prefill(torch.tensor(prompt))
    out = [int(logits.argmax())]
    while out[-1] not in stop and len(out) < min(max_new, MAX_LEN - len(prompt)):
        out.append(int(runner.decode(torch.tensor(out[-1]), len(prompt) + len(out) - 1).argmax()))
    return out


def prompts(n: int, seed: int = 0) -> list[tuple[str, list[int]]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = [3, 17, 9, 30, 5, 12, 60][:n]
    return [(f"p{i}", torch.randint(0, VOCAB, (L,), generator=gen).tolist()) for i, L in enumerate(lengths)]


def test_greedy_rows_equal_decoding_alone(model) -> None:
    items = prompts(7)
    # A stop id that some rows produce: the most frequent first token of the sequences decoded alone.
    firsts = [greedy_alone(model, ids, 1, set())[0] for _, ids in items]
    stop = {max(set(firsts[1:]), key=firsts.count)} if len(set(firsts)) > 1 else set()
    assert stop, "the tiny model's first tokens are all equal: no stop id to test with"
    for stop_ids in (stop, set()):
        expected = {key: greedy_alone(model, ids, 12, stop_ids) for key, ids in items}
        generator = BatchGenerator(model, slots=3, max_len=MAX_LEN, stop_ids=stop_ids)
        got = dict(generator.generate(items, 12, SamplingParams(temperature=0.0)))
        assert got == expected
        if stop_ids:
            assert any(len(v) < 12 and v[-1] in stop for v in got.values())
    assert len(got["p6"]) == MAX_LEN - 60  # no stop ids: cut at the end of the cache row


def test_sampling_reproduces_with_its_seed_and_follows_the_slots(model) -> None:
    items = prompts(5, seed=1)
    params = SamplingParams(temperature=1.0, seed=3)
    run = lambda slots: dict(BatchGenerator(model, slots, MAX_LEN, stop_ids=()).generate(items, 8, params))  # noqa: E731
    first, again = run(2), run(2)
    assert first == again and all(len(v) == 8 for v in first.values())
    assert run(5) != first  # rows share the generator: another batch layout draws other tokens


def test_bad_input(model) -> None:
    with pytest.raises(ValueError, match="slots"):
        BatchGenerator(model, 0, MAX_LEN, ())
    generator = BatchGenerator(model, 2, MAX_LEN, ())
    with pytest.raises(ValueError, match="cache rows hold"):
        list(generator.generate([("long", [1] * MAX_LEN)], 4, SamplingParams()))
    with pytest.raises(ValueError, match="temperature"):
        list(generator.generate([("a", [1, 2])], 4, SamplingParams(temperature=-1.0)))


def test_decode_steps_read_a_bucketed_key_length(model, monkeypatch) -> None:
    """Each decode step's key length is a power-of-two bucket (`key_length_bucket`), not max(position) + 1: a
    new shape every step re-timed the decode kernel choice every step on CUDA (data generation ran 50x slower)."""
    seen: list[int] = []
    forward = type(model).forward

    def recording(self, ids, positions, cache, kv_len, **kw):
        if ids.shape[1] == 1:
            seen.append(kv_len)
        return forward(self, ids, positions, cache, kv_len=kv_len, **kw)

    monkeypatch.setattr(type(model), "forward", recording)
    list(BatchGenerator(model, 3, MAX_LEN, stop_ids=()).generate(prompts(4), 10, SamplingParams()))
    assert len(seen) >= 10 and set(seen) == {MAX_LEN}  # every position here is under the smallest bucket


def test_key_length_bucket() -> None:
    assert [key_length_bucket(p, 4096) for p in (0, 255, 256, 1000, 4095)] == [256, 256, 512, 1024, 4096]
    assert key_length_bucket(300, 320) == 320


class ReplayedFirstCapture:
    """Stands in for `PhaseGraphs` on the CPU with a CUDA graph's semantics: a key's first call runs for real
    (state-advancing phase) and is what every later call of that key "replays" — the first closure, reading
    whatever its static buffers hold then. A step that depended on anything but those buffers would go wrong."""

    enabled = True

    def __init__(self) -> None:
        self.captured: dict[tuple, object] = {}

    def __contains__(self, key: tuple) -> bool:
        return key in self.captured

    def run(self, key: tuple, phase, advances_state: bool = False) -> None:
        assert advances_state
        self.captured.setdefault(key, phase)()


def test_decode_steps_replayed_from_static_buffers_equal_eager(model) -> None:
    items = prompts(6, seed=2)
    eager_generator = BatchGenerator(model, 3, MAX_LEN, stop_ids=(), use_cuda_graph=False)
    eager = dict(eager_generator.generate(items, 10, SamplingParams()))
    generator = BatchGenerator(model, 3, MAX_LEN, stop_ids=())
    generator.runner.graphs = ReplayedFirstCapture()
    assert dict(generator.generate(items, 10, SamplingParams())) == eager
    captured = list(generator.runner.graphs.captured)
    assert captured[0] == ("decode", 3, MAX_LEN) and {key[1] for key in captured} <= {1, 2, 3}
