"""The adaptive speculation budget: before each step, the proposal size that maximises expected tokens per second.

Every candidate size b (drafts verified below the root; 0 is a plain decode step that drafts nothing) has a step
time T(b), measured on this machine when the decoder is built (`SpeculativeDecoder.measure_step_times`). Each
draft gives, for every size at once, the drafter-side estimate E(b) of the drafts the target would accept
(`spec.acceptance_estimate`). Drafters are not calibrated and Weaver's trees accept more than the marginals'
best-first tree, so each size's estimate is scaled by c(b) = EMA(accepted) / EMA(E(b)) over the steps taken at
that size. The step takes argmax_b (1 + c(b) E(b)) / T(b): the expected tokens (accepted drafts plus the target's
own) per second.

A step at size 0 drafts nothing, so while the choice stays at 0 a step drafts anyway every so often, to see
whether speculation pays again. The interval starts where probing costs at most `PROBE_SHARE` of the decode
time (a draft of `probe_seconds` every n steps of T(0)) and doubles after each probe that still chooses 0 (up to
`MAX_PROBE_INTERVAL`), so a machine where speculation never pays (a CPU) loses almost nothing to probing. The choice depends only on what happened before the step, never on the
step's own target draws, so acceptance stays lossless whatever sizes are chosen.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

PRIOR = 0.5  # pseudo-drafts added to both sides of c(b): a few steps cannot swing it far from 1
PROBE_SHARE = 0.01
MAX_PROBE_INTERVAL = 1024


class BudgetController:
    def __init__(self, sizes: Sequence[int], step_seconds: dict[int, float], probe_seconds: float = 0.0,
                 probe_every: int = 16, smoothing: float = 0.1) -> None:
        """sizes: the candidate sizes, 0 included; step_seconds: T(b) for each of them; probe_seconds: what one
        draft costs; probe_every: the shortest interval between probes."""
        if 0 not in sizes or set(step_seconds) != set(sizes):
            raise ValueError(f"sizes must include 0 and each needs a step time: {list(sizes)} vs {sorted(step_seconds)}")
        self.sizes = tuple(sorted(sizes))
        self.step_seconds = dict(step_seconds)
        self.probe_every = max(probe_every, math.ceil(probe_seconds / (PROBE_SHARE * self.step_seconds[0])))
        self.smoothing = smoothing
        self._accepted: dict[int, float] = {}
        self._predicted: dict[int, float] = {}
        self._last_size: int | None = None
        self._steps_since_draft = 0
        self._probe_interval = self.probe_every
        self.chosen: Counter[int] = Counter()

    def calibration(self, size: int) -> float:
        """c(size): realised over predicted accepted drafts (smoothed, and pulled towards 1 while both are small);
        a size not yet tried borrows the calibration of the nearest size that was, else 1."""
        tried = self._predicted.keys()
        if size not in tried:
            if not tried:
                return 1.0
            size = min(tried, key=lambda b: (abs(b - size), b))
        return (self._accepted[size] + PRIOR) / (self._predicted[size] + PRIOR)

    def tokens_per_second(self, estimate: Sequence[float]) -> dict[int, float]:
        """Expected tokens per second of each size, given the draft's estimates (in `sizes` order)."""
        return {b: (1.0 + self.calibration(b) * e) / self.step_seconds[b] for b, e in zip(self.sizes, estimate)}

    def wants_draft(self) -> bool:
        """Whether the coming step should draft: always, unless the last step chose size 0; then only the
        `probe_every`-th step after the last draft."""
        return self._last_size != 0 or self._steps_since_draft + 1 >= self._probe_interval

    def choose(self, estimate: Sequence[float] | None) -> int:
        """The size of the coming step: the best expected rate given a draft's estimates, else 0."""
        if estimate is None:
            size = 0
        else:
            rates = self.tokens_per_second(estimate)
            size = max(self.sizes, key=rates.__getitem__)
        self.chosen[size] += 1
        if estimate is not None:  # a draft was made: speculating resets the probe interval, a failed probe doubles it
            probe_failed = size == 0 and self._last_size == 0
            self._probe_interval = min(2 * self._probe_interval, MAX_PROBE_INTERVAL) if probe_failed else self.probe_every
        self._last_size = size
        self._steps_since_draft = 0 if estimate is not None else self._steps_since_draft + 1
        return size

    def observe(self, size: int, predicted: float, accepted: int) -> None:
        """A step at `size` whose estimate was `predicted` accepted `accepted` drafts."""
        if size == 0:
            return
        a = self.smoothing
        if size not in self._predicted:
            self._accepted[size], self._predicted[size] = float(accepted), float(predicted)
        else:
            self._accepted[size] += a * (accepted - self._accepted[size])
            self._predicted[size] += a * (predicted - self._predicted[size])
