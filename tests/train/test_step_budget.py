"""StepBudget: the step count shrinks once, after calibration, to what the measured pace allows."""
import pytest

from dflash_tfm.train import step_budget
from dflash_tfm.train.step_budget import StepBudget


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(step_budget.time, "monotonic", fake)
    return fake


def run(budget: StepBudget, clock: FakeClock, seconds_per_step: float, first_steps: float | None = None) -> int:
    budget.begin()
    done = 0
    while done < budget.steps:
        slow = first_steps is not None and done < 3
        clock.now += first_steps if slow else seconds_per_step
        done += 1
        budget.after_step(done)
    return done


def test_fits_the_budget(clock: FakeClock) -> None:
    clock.now = 0.0
    budget = StepBudget(1000, seconds=100.0, skip=0, calibrate=20, reserve=0.1)
    clock.now = 10.0  # setup (first validation) before the steps
    assert run(budget, clock, 0.5) == 20 + int((90.0 - 10.0 - 10.0) / 0.5)
    assert "of 1000 requested" in budget.note()


def test_slow_first_steps_do_not_set_the_pace(clock: FakeClock) -> None:
    budget = StepBudget(1000, seconds=100.0, skip=5, calibrate=25, reserve=0.0)
    # 3 warm-up steps of 5 s, then 0.1 s per step: 15 + 2.2 s spent at step 25, pace 0.1 s
    assert abs(run(budget, clock, 0.1, first_steps=5.0) - (25 + (100.0 - 17.2) / 0.1)) <= 1  # not 25 + 82.8 / 0.7


def test_never_raises_the_request_or_drops_below_done(clock: FakeClock) -> None:
    assert run(StepBudget(50, seconds=1e6, calibrate=20), clock, 0.1) == 50
    assert run(StepBudget(50, seconds=1.0, calibrate=20), clock, 1.0) == 20  # already over budget: stop now
    assert run(StepBudget(10, seconds=1.0, calibrate=20), clock, 1.0) == 10  # calibrates at the last step
    assert run(StepBudget(30, seconds=None), clock, 100.0) == 30


def test_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="steps"):
        StepBudget(0)
    with pytest.raises(ValueError, match="budget"):
        StepBudget(10, seconds=0)


def test_refits_when_the_pace_changes(clock: FakeClock) -> None:
    """Validations make later steps slower on average: the count is refitted at doubling step counts."""
    budget = StepBudget(10_000, seconds=100.0, skip=0, calibrate=25, reserve=0.05)
    budget.begin()
    done = 0
    while done < budget.steps:
        clock.now += 0.1 if done < 25 else 0.3
        done += 1
        budget.after_step(done)
        if done == 25:
            assert abs(budget.steps - 950) <= 1  # 0.1 s per step so far
    assert 90.0 <= clock.now <= 100.0 and done < 950  # the average pace lags; the reserve absorbs it


def test_schedule_stretches_with_the_budget_but_never_rises_after_its_peak(clock: FakeClock) -> None:
    """Slow first steps, then fast ones: every refit grows the count, one of them after the decay has begun.
    Warm-up and decay follow the new count, but a decay already begun is held, never sent back up (WSD: flat
    at 1 until the last 20 %, then linear to 0)."""
    def wsd(step: int, total: int) -> float:
        warmup, decay_start = max(1, total // 25), total - max(1, total // 5)
        if step < warmup:
            return min(1.0, (step + 1) / warmup)
        return 1.0 if step < decay_start else (total - step) / (total - decay_start)

    budget = StepBudget(100_000, seconds=100.0, skip=0, calibrate=25, reserve=0.0)
    factor = budget.schedule(wsd)
    budget.begin()
    factors, done, grew_while_decaying = [factor(0)], 0, False
    while done < budget.steps:
        clock.now += 0.5 if done < 25 else 0.01
        done += 1
        before = budget.steps
        budget.after_step(done)
        grew_while_decaying |= budget.steps > before and factors[-1] < 1.0 and 1.0 in factors
        factors.append(factor(done))
    peak = factors.index(1.0)
    assert grew_while_decaying
    assert all(b <= a for a, b in zip(factors[peak:], factors[peak + 1:]))
    assert factors[-1] == pytest.approx(0.0, abs=1e-3) and 90.0 <= clock.now <= 100.0
