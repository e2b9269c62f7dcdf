"""A training run's step count, fitted to a wall-clock budget.

Why: GPU time comes in fixed slices (a device call, a job limit). A run stopped by a timer ends mid-schedule
at a high learning rate; instead the run measures its own pace over its first steps and, once, lowers its
step count so the whole schedule (warm-up, decay to the end) fits the budget. Learning-rate schedules read
``budget.steps`` at every step, so they stretch to whatever count is chosen.
"""
from __future__ import annotations

import time


class StepBudget:
    """``steps`` optimizer steps, or fewer when ``seconds`` would run out first.

    The budget is measured from construction (so setup such as a first validation counts), the pace over steps
    ``skip`` .. ``calibrate`` (the first steps pay for kernel selection and allocator warm-up and would make
    the pace look slow); ``reserve`` of the budget is kept for later validations and saving.
    """

    def __init__(
        self, steps: int, seconds: float | None = None, *, skip: int = 5, calibrate: int = 25, reserve: float = 0.15,
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
        if done != self.calibrate or self._pace_start is None:
            return False
        now = time.monotonic()
        pace = (now - self._pace_start) / (done - self.skip)
        left = self.seconds * (1.0 - self.reserve) - (now - self.start)
        fitted = max(done, min(self.requested, done + int(left / pace)))
        changed, self.steps = fitted != self.steps, fitted
        return changed

    def note(self) -> str:
        """One line for logs: what the budget did."""
        if self.steps == self.requested:
            return f"{self.steps} steps"
        return f"{self.steps} steps (of {self.requested} requested: time budget {self.seconds:.0f} s)"
