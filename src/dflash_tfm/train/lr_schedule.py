"""Learning-rate shapes shared by the trainers: a factor (peak 1) of the step and the step count.

`cosine`: linear warm-up, cosine decay to 0 at the end. `wsd` (warmup-stable-decay): warm-up, a long flat phase
at the peak, linear decay to 0 over the last `decay_frac`. `constant`: warm-up, then the peak until the end —
the first half of a WSD run split across two time-limited jobs, whose second job (`--init-from` the first's
model) runs `cosine` down from the peak (an H200 call holds ~5 minutes of drafter training; one longer cycle
decays from a better point than two short ones that each restart their warm-up).
"""
from __future__ import annotations

import math

SCHEDULES = ("cosine", "wsd", "constant")


def check_schedule(schedule: str) -> None:
    """A clear error for an unknown name (the trainers call it before loading anything)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")


def lr_factor(step: int, steps: int, schedule: str, warmup_frac: float = 0.04, decay_frac: float = 0.2) -> float:
    """The factor at optimizer step `step` (0-based) of `steps`."""
    check_schedule(schedule)
    warmup = max(1, round(warmup_frac * steps))
    if schedule == "constant" or step < warmup:
        return min(1.0, (step + 1) / warmup)
    if schedule == "cosine":
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))
    decay_start = steps - max(1, round(decay_frac * steps))
    return 1.0 if step < decay_start else max(0.0, (steps - step) / (steps - decay_start))
