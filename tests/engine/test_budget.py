"""BudgetController: the size with the best expected tokens per second, calibrated by what steps accepted."""
from __future__ import annotations

import pytest

from dflash_tfm.engine.budget import BudgetController

SIZES = (0, 8, 32)
TIMES = {0: 1.0, 8: 1.5, 32: 3.0}


def test_choice_maximises_expected_tokens_per_second() -> None:
    c = BudgetController(SIZES, TIMES)
    assert c.choose([0.0, 0.2, 0.3]) == 0  # (1 + 0.2) / 1.5 < 1 / 1
    assert c.choose([0.0, 2.0, 2.5]) == 8  # 3 / 1.5 = 2 > 3.5 / 3
    assert c.choose([0.0, 2.0, 6.0]) == 32  # 7 / 3 > 2
    assert c.chosen == {0: 1, 8: 1, 32: 1}


def test_calibration_scales_the_estimate_of_the_size_taken_and_its_neighbours() -> None:
    c = BudgetController(SIZES, TIMES, smoothing=0.5)
    assert c.calibration(8) == 1.0
    for _ in range(20):
        c.observe(8, predicted=1.0, accepted=3)  # the drafter underestimates by 3x
    assert c.calibration(8) == pytest.approx(3.5 / 1.5, rel=1e-6)
    assert c.calibration(32) == c.calibration(8)  # untried: borrowed from the nearest tried size
    c.observe(0, predicted=5.0, accepted=0)  # size 0 drafts nothing: no evidence
    assert c.calibration(0) == c.calibration(8)
    assert c.choose([0.0, 1.0, 1.2]) == 8  # (1 + 2.33) / 1.5 > 1, and > (1 + 2.8) / 3


def test_decode_steps_probe_with_a_draft_ever_less_often_until_speculation_pays() -> None:
    c = BudgetController(SIZES, TIMES, probe_every=4)
    assert c.wants_draft()
    assert c.choose([0.0, 0.0, 0.0]) == 0
    drafts = []
    for _ in range(16):
        drafts.append(c.wants_draft())
        c.choose([0.0, 0.0, 0.0] if drafts[-1] else None)
    probes = [i for i, d in enumerate(drafts) if d]
    assert probes == [3, 11]  # after 4 steps, then (that probe chose 0 again) after 8
    c.choose([0.0, 5.0, 5.0])  # the next probe finds speculation paying...
    for _ in range(3):
        drafts.append(c.wants_draft())
        c.choose([0.0, 5.0, 5.0] if drafts[-1] else None)
    assert drafts[-3:] == [True, True, True] and c.chosen[8] == 4
    assert c.choose([0.0, 0.0, 0.0]) == 0  # ...and a step back at 0 probes at the base interval again
    assert [c.wants_draft() or c.choose(None) for _ in range(3)] == [0, 0, 0] and c.wants_draft()


def test_sizes_need_zero_and_times() -> None:
    with pytest.raises(ValueError, match="must include 0"):
        BudgetController((8, 16), {8: 1.0, 16: 2.0})
    with pytest.raises(ValueError, match="step time"):
        BudgetController((0, 8), {0: 1.0})
