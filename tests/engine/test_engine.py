"""Engine behaviour on the real embedded model: limits, stop conditions, seeds, streaming, bad input."""
from __future__ import annotations

import pytest

from dflash_tfm import Engine, SamplingParams, SpeculativeConfig

CHAT = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]


def test_max_new_tokens_and_length_finish(smollm2: Engine) -> None:
    out = smollm2.generate(CHAT, SamplingParams(max_new_tokens=7, ignore_eos=True))
    assert len(out.token_ids) == 7 and out.finish_reason == "length"
    assert out.stats.completion_tokens == 7 and out.stats.verify_steps == 7
    assert out.stats.accept_length == 1.0
    assert out.stats.prompt_tokens == len(smollm2.apply_chat_template(CHAT))


def test_eos_stops_generation(smollm2: Engine) -> None:
    out = smollm2.generate("What is 2 + 2?", SamplingParams(max_new_tokens=200), chat=True)
    assert out.finish_reason == "stop" and out.token_ids[-1] in smollm2.eos_token_ids
    assert len(out.token_ids) < 200


def test_stop_string_truncates_text(smollm2: Engine) -> None:
    full = smollm2.generate(CHAT, SamplingParams(max_new_tokens=40, ignore_eos=True))
    words = full.text.split()
    stop = " ".join(words[5:7])
    out = smollm2.generate(CHAT, SamplingParams(max_new_tokens=40, stop=[stop], ignore_eos=True))
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.index(stop)]
    assert stop not in out.text and len(out.token_ids) < 40


def test_stop_token_ids(smollm2: Engine) -> None:
    full = smollm2.generate(CHAT, SamplingParams(max_new_tokens=20, ignore_eos=True))
    target = full.token_ids[5]
    first = full.token_ids.index(target)
    out = smollm2.generate(CHAT, SamplingParams(max_new_tokens=20, stop_token_ids=[target], ignore_eos=True))
    assert out.token_ids == full.token_ids[: first + 1] and out.finish_reason == "stop"


def test_seeded_sampling_is_reproducible(smollm2: Engine) -> None:
    p = lambda seed: SamplingParams(temperature=1.0, top_p=0.95, top_k=50, max_new_tokens=24, seed=seed, ignore_eos=True)  # noqa: E731
    a, b = smollm2.generate(CHAT, p(7)), smollm2.generate(CHAT, p(7))
    c = smollm2.generate(CHAT, p(8))
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_stream_equals_generate(smollm2: Engine) -> None:
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    deltas = list(smollm2.stream(CHAT, params))
    out = smollm2.generate(CHAT, params)
    assert "".join(d.text for d in deltas) == out.text
    assert [t for d in deltas for t in d.token_ids] == out.token_ids
    assert deltas[-1].finish_reason == "length" and all(d.finish_reason is None for d in deltas[:-1])


def test_closing_a_stream_early_frees_the_engine(smollm2: Engine) -> None:
    params = SamplingParams(max_new_tokens=50, ignore_eos=True)
    stream = smollm2.stream(CHAT, params)
    next(stream)
    stream.close()
    assert smollm2.generate(CHAT, params).token_ids == smollm2.generate(CHAT, params).token_ids


def test_prompt_longer_than_context_is_rejected(smollm2: Engine) -> None:
    with pytest.raises(ValueError, match="context"):
        smollm2.generate(list(range(100, 700)), SamplingParams(max_new_tokens=4))


def test_generation_is_cut_at_the_context_end(smollm2: Engine) -> None:
    out = smollm2.generate(list(range(100, 550)), SamplingParams(max_new_tokens=100, ignore_eos=True))
    assert len(out.token_ids) == 512 - 450 and out.finish_reason == "length"


@pytest.mark.parametrize(
    "prompt, match",
    [([], "empty"), ([5, 10**6], "out of range"), ([1, -3], "out of range"), ([1.5, 2], "token ids")],
)
def test_bad_prompts(smollm2: Engine, prompt, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        smollm2.generate(prompt, SamplingParams(max_new_tokens=2))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(seed="x"), "seed"),
        (dict(stop=[""]), "stop"),
    ],
)
def test_invalid_sampling_values(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_unknown_speculative_algorithm_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"unknown algorithm \(--speculative-algorithm\) 'MEDUSA'"):
        Engine(speculative=SpeculativeConfig("MEDUSA"))
