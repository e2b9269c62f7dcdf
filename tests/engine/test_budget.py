"""BudgetController: the size with the best expected tokens per second, calibrated by what steps accepted."""
from __future__ import annotations

import pytest

from dflash_tfm.engine.budget import MARGIN, MIN_DRAFTS, BudgetController

SIZES = (0, 8, 32)
TIMES = {0: 1.0, 8: 1.5, 32: 3.0}


def test_the_size_follows_the_smoothed_rates_and_a_poor_draft_decodes() -> None:
    c = BudgetController(SIZES, TIMES, draft_seconds=0.25)
    assert c.choose([0.0, 2.0, 2.5]) == 8  # 3 / 1.5 = 2 > 3.5 / 3 and > 1 / (1 + 0.25)
    assert c.choose([0.0, 0.1, 0.2]) == 0  # this draft: (1 + 0.1) / 1.5 < 1 / (1 + 0.25): decode, then draft again
    sizes = [c.choose([0.0, 2.0, 6.0]) for _ in range(10)]  # 7 / 3 > 3 / 1.5, draft after draft
    assert sizes[0] == 8 and sizes[-1] == 32  # one draft does not switch the size; a run of them does
    assert c.chosen[0] == 1


def test_calibration_scales_the_estimate_of_the_size_taken_and_its_neighbours() -> None:
    c = BudgetController(SIZES, TIMES, smoothing=0.5)
    assert c.calibration(8) == 1.0
    for _ in range(20):
        c.observe(8, predicted=1.0, accepted=3)  # the drafter underestimates by 3x
    assert c.calibration(8) == pytest.approx(3.5 / 1.5, rel=1e-6)
    assert c.calibration(32) == c.calibration(8)  # untried: borrowed from the tried sizes
    c.observe(0, predicted=5.0, accepted=0)  # size 0 drafts nothing: no evidence
    assert c.calibration(0) == c.calibration(8)
    assert c.choose([0.0, 1.0, 1.2]) == 8  # (1 + 2.33) / 1.5 > 1, and > (1 + 2.8) / 3


def test_a_hard_token_takes_size_0_but_drafting_goes_on() -> None:
    """Speculation pays on average (gain > 1), so one draft with a poor estimate decodes plainly this step and
    the next step drafts again: without a draft there would be no estimate to resume from."""
    c = BudgetController(SIZES, TIMES)
    for _ in range(5):
        assert c.wants_draft() and c.choose([0.0, 3.0, 5.0]) == 8
    assert c.choose([0.0, 0.0, 0.0]) == 0
    assert c.gain > 1 and c.wants_draft()
    assert c.choose([0.0, 3.0, 5.0]) == 8


def test_when_speculation_stops_paying_steps_decode_and_probe_ever_less_often() -> None:
    c = BudgetController(SIZES, TIMES, probe_every=4)
    drafts = []
    for _ in range(50):
        drafts.append(c.wants_draft())
        c.choose([0.0, 0.1, 0.1] if drafts[-1] else None)
    assert c.gain < 1 and not c.speculating
    probes = [i for i, d in enumerate(drafts) if d]
    last = MIN_DRAFTS - 1  # every step drafts until MIN_DRAFTS drafts were seen
    assert probes == list(range(MIN_DRAFTS)) + [last + 4, last + 12, last + 28]  # after 4 steps, then 8, then 16
    assert c.chosen[0] == 49 and c.chosen[8] == 1  # the first draft is verified: nothing is calibrated before
    c.start_request()  # a new request probes at the shortest interval again
    assert [c.wants_draft() or c.choose(None) for _ in range(4)] == [0, 0, 0, True]


def test_probes_that_find_speculation_paying_resume_drafting() -> None:
    c = BudgetController(SIZES, TIMES, probe_every=2)
    for _ in range(MIN_DRAFTS + 4):
        c.choose([0.0, 0.0, 0.0] if c.wants_draft() else None)
    assert not c.speculating
    sizes = []
    for _ in range(60):
        sizes.append(c.choose([0.0, 5.0, 5.0] if c.wants_draft() else None))
        if c.speculating:
            break
    assert c.speculating and sizes[-1] == 8  # a paying probe speculates at once, though the gain lags
    assert sizes.count(8) <= 10  # a few probes raise the gain above 1
    assert all(c.wants_draft() and c.choose([0.0, 5.0, 5.0]) == 8 for _ in range(3))


def test_a_gain_within_the_margin_does_not_start_drafting() -> None:
    c = BudgetController(SIZES, TIMES)
    for _ in range(40):  # (1 + 0.55) / 1.5 = 1.03 x the decode rate: inside the margin
        c.choose([0.0, 0.55, 0.55] if c.wants_draft() else None)
    assert 1.0 < c.gain < 1.0 + MARGIN and not c.speculating
    assert c.chosen[8] == MIN_DRAFTS - 1  # while every draft was verified 1.03 x beat decoding; as probes, not


def test_forget_returns_to_the_state_after_build() -> None:
    c = BudgetController(SIZES, TIMES, probe_every=2)
    fresh = [c.choose([0.0, 0.0, 0.0] if c.wants_draft() else None) for _ in range(6)]
    c.observe(8, predicted=1.0, accepted=3)
    c.forget()
    assert c.gain is None and c.calibration(8) == 1.0 and not c.chosen
    assert [c.choose([0.0, 0.0, 0.0] if c.wants_draft() else None) for _ in range(6)] == fresh


def test_realised_step_times_replace_the_start_up_measurement() -> None:
    """A size that grew dearer with the context (its wall times) loses the choice; forget restores the times."""
    c = BudgetController(SIZES, TIMES, smoothing=0.5)
    assert c.choose([0.0, 2.0, 6.0]) == 32  # 7 / 3 > 3 / 1.5
    for _ in range(10):
        c.observe_seconds(32, 4.0)
    assert c.step_seconds[32] == pytest.approx(4.0, rel=1e-3) and c.step_seconds[8] == 1.5
    assert [c.choose([0.0, 2.0, 6.0]) for _ in range(5)][-1] == 8  # 7 / 4 < 3 / 1.5, once smoothed
    c.forget()
    assert c.step_seconds == TIMES


def test_one_stalled_step_does_not_rule_its_size_out() -> None:
    """A step that stalled (a graph captured, a kernel tuned: a hundred times its usual time) moves T(b) as a
    step of twice the time would; the size is still taken, and steady times bring T(b) back."""
    c = BudgetController(SIZES, TIMES)
    assert c.choose([0.0, 2.0, 6.0]) == 32
    c.observe_seconds(32, 300.0)
    assert c.step_seconds[32] == pytest.approx(3.0 + 0.1 * (2 * 3.0 - 3.0))
    assert [c.choose([0.0, 2.0, 6.0]) for _ in range(20)][-1] == 32  # 7 / 3.3 > 3 / 1.5
    for _ in range(100):
        c.observe_seconds(32, 3.0)
    assert c.step_seconds[32] == pytest.approx(3.0, rel=1e-3)


def test_sizes_need_zero_and_times() -> None:
    with pytest.raises(ValueError, match="must include 0"):
        BudgetController((8, 16), {8: 1.0, 16: 2.0})
    with pytest.raises(ValueError, match="step time"):
        BudgetController((0, 8), {0: 1.0})


def test_untried_sizes_borrow_the_most_optimistic_calibration() -> None:
    """A size never taken is valued with the largest calibration seen, so a size whose raw estimate undervalues it
    gets tried (and then calibrated) rather than skipped forever."""
    c = BudgetController((0, 8, 16, 32), {0: 1.0, 8: 1.5, 16: 2.0, 32: 3.0}, smoothing=0.5)
    for _ in range(20):
        c.observe(8, predicted=1.0, accepted=1)
        c.observe(16, predicted=1.0, accepted=3)
    assert c.calibration(32) == c.calibration(16) > c.calibration(8)


def test_the_first_draft_is_verified_then_hard_tokens_may_decode() -> None:
    c = BudgetController(SIZES, TIMES, draft_seconds=0.25)
    assert c.choose([0.0, 0.1, 0.2]) == 8  # uncalibrated: verified at the best size though 0 looks faster
    c.observe(8, predicted=0.1, accepted=0)
    assert c.choose([0.0, 0.1, 0.2]) == 0
    c.forget()
    assert c.choose([0.0, 0.1, 0.2]) == 8
