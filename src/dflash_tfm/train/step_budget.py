"""A training run's step count, fitted to a wall-clock budget.

Why: GPU time comes in fixed slices (a device call, a job limit). A run stopped by a timer ends mid-schedule
at a high learning rate; instead the run measures its own pace and sets its step count so the whole schedule
(warm-up, decay to the end) fits the budget: first after a few steps, then again at doubling step counts, as
the pace (validations included) becomes known better. Learning-rate schedules (``budget.schedule``) read
``budget.steps`` at every step, so they stretch to whatever count is chosen, warm-up included; once past their
peak they never rise again: a refit that stretches a schedule whose decay has begun holds the learning rate
instead (an H200 WSD run otherwise jumped from 4e-4 back to its 1e-3 peak at step 3200 of 4488).
"""
from __future__ import annotations

import time
from collections.abc import Callable

from tqdm.auto import tqdm


class StepBudget:
    """``steps`` optimizer steps, or fewer when ``seconds`` would run out first.

    The budget is measured from construction (so setup such as a first validation counts); the pace from step
    ``skip`` on (the first steps pay for kernel selection and allocator warm-up and would make it look slow),
    refitted at steps ``calibrate``, 2·``calibrate``, 4·``calibrate``, …; ``reserve`` of the budget is kept for
    the last validation and saving. The count never exceeds the request nor drops below the steps done.
    """

    def __init__(
        self, steps: int, seconds: float | None = None, *, skip: int = 5, calibrate: int = 25, reserve: float = 0.05,
    ) -> None:
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        if seconds is not None and seconds <= 0:
            raise ValueError(f"a time budget must be > 0 seconds, got {seconds}")
        self.steps = steps
        self.requested = steps
        self.seconds = seconds
        self.calibrate = min(calibrate, steps)
        self.skip = min(skip, self.calibrate - 1)
        self.reserve = reserve
        self.start = time.monotonic()
        self._pace_start: float | None = None

    def begin(self) -> None:
        """Call right before the first optimizer step."""
        if self.skip == 0:
            self._pace_start = time.monotonic()

    def after_step(self, done: int) -> bool:
        """Call after each step (``done`` steps finished); True when this call changed ``steps``."""
        if self.seconds is None:
            return False
        if done == self.skip:
            self._pace_start = time.monotonic()
        multiple = done // self.calibrate
        if done % self.calibrate or multiple & (multiple - 1) or self._pace_start is None:
            return False
        now = time.monotonic()
        pace = (now - self._pace_start) / (done - self.skip)
        left = self.seconds * (1.0 - self.reserve) - (now - self.start)
        fitted = max(done, min(self.requested, done + int(left / pace)))
        changed, self.steps = fitted != self.steps, fitted
        return changed

    def step_done(self, done: int, bar: tqdm) -> bool:
        """`after_step` for a loop with a progress bar: advances the bar, retargets it (with a note) when the
        count changes. True when ``done`` is the last step."""
        bar.update()
        if self.after_step(done):
            bar.total = self.steps
            bar.write(f"time budget: {self.note()}")
        return done == self.steps

    def note(self) -> str:
        """One line for logs: what the budget did."""
        if self.steps == self.requested:
            return f"{self.steps} steps"
        return f"{self.steps} steps (of {self.requested} requested: time budget {self.seconds:.0f} s)"

    def schedule(self, shape: Callable[[int, int], float]) -> Callable[[int], float]:
        """A ``LambdaLR`` factor: ``shape(step, steps)`` (peak 1) at the current ``steps``, held at its lowest
        value so far once it has reached its peak (see the module docstring)."""
        state = {"peaked": False, "last": 0.0}

        def factor(step: int) -> float:
            value = shape(step, self.steps)
            if state["peaked"]:
                value = min(value, state["last"])
            state["peaked"] = state["peaked"] or value >= 1.0
            state["last"] = value
            return value

        return factor
