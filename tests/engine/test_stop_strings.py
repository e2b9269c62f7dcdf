"""Stop-string matching: same answers as searching the whole text, in time linear in the text."""
from __future__ import annotations

import random
import time

import pytest

from dflash_tfm.engine.stop_strings import StopStringMatcher
from dflash_tfm.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS, SamplingParams


def _first_stop(text: str, stops: list[str]) -> int | None:
    found = [i for i in (text.find(s) for s in stops) if i != -1]
    return min(found) if found else None


def _longest_pending_prefix(text: str, stops: list[str]) -> int:
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


@pytest.mark.parametrize("seed", range(40))
def test_matches_brute_force_on_random_text(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = "ab" if seed % 2 else "abc"
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 3))]
    matcher, text = StopStringMatcher(stops), ""
    while True:
        chunk = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 4)))
        expected = _first_stop(text + chunk, stops)
        got = matcher.feed(chunk)
        text += chunk
        if expected is not None:  # every occurrence ends in this chunk (none did before): the earliest start
            assert got == expected
            break
        assert got is None
        assert matcher.hold == _longest_pending_prefix(text, stops)
        if len(text) > 200:
            break


def test_overlapping_stop_strings_report_the_earliest_start() -> None:
    matcher = StopStringMatcher(["abcd", "c"])
    assert matcher.feed("xab") is None and matcher.hold == 2
    assert matcher.feed("c") == 3  # "c" completes, while "abcd" is still a pending prefix
    matcher = StopStringMatcher(["abcd", "c"])
    assert matcher.feed("xabcd") == 1  # both complete within one chunk: the earlier start wins


def test_long_stop_string_costs_little_per_token() -> None:
    stop = "ab" * 80_000  # 160 kB, beyond what requests may send; the matcher itself stays linear
    matcher = StopStringMatcher([stop])
    text = ("ab" * 1000 + "x") * 10
    start = time.perf_counter()
    for i in range(0, len(text), 4):  # 4 characters per token
        assert matcher.feed(text[i : i + 4]) is None
    per_token = (time.perf_counter() - start) / (len(text) / 4)
    assert per_token < 1e-3, per_token


def test_sampling_params_bound_stop_strings() -> None:
    SamplingParams(stop=["x" * MAX_STOP_CHARS] * MAX_STOP_STRINGS)
    with pytest.raises(ValueError, match="^stop: at most"):
        SamplingParams(stop=["x"] * (MAX_STOP_STRINGS + 1))
    with pytest.raises(ValueError, match="^stop: each stop string"):
        SamplingParams(stop=["x" * (MAX_STOP_CHARS + 1)])
