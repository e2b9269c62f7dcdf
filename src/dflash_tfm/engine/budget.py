"""The adaptive speculation budget: before each step, the proposal size that maximises expected tokens per second.

Every candidate size b (drafts verified below the root; 0 is a plain decode step that drafts nothing) has a step
time T(b), measured on this machine when the decoder is built (`SpeculativeDecoder.measure_step_times`) and
then followed by the wall time of the steps taken at that size (`observe_seconds`, smoothed): a step's draft and
verify grow with the context, and a request's context is not the short one the start-up measured. A step of size
b > 0 includes the next step's draft, a plain decode step does not. Each draft gives, for every size at
once, the drafter-side estimate E(b) of the drafts the target would accept (`spec.acceptance_estimate`). Drafters
are not calibrated and Weaver's trees accept more than the marginals' best-first tree, so each size's estimate is
scaled by c(b) = EMA(accepted) / EMA(E(b)) over the steps taken at that size. A size never taken borrows the
largest calibration of the sizes taken: an optimistic guess is corrected by the steps that take the size, a
pessimistic one never would be, since a size that looks too poor to take stays untaken. For the same reason the
first draft is always verified (at its best size): before any size is calibrated, the estimates alone tend to
undervalue trees against a plain decode step.

Two decisions are made, on two time scales:

* **Whether to keep drafting** (slow). Each draft's best expected rate max_b (1 + c(b) E(b)) / T(b), relative to
  plain decoding's 1 / T(0), is smoothed into the *gain* of speculation. While the gain exceeds 1 + `MARGIN` (room
  for older step times and a lagging calibration) every step drafts. One draft with a poor estimate (a hard token)
  must not stop speculation: without drafts there is no estimate to resume from, so a per-step choice of 0 that also
  stopped drafting would trap a request in plain decoding. Once the gain falls to 1 + `MARGIN` or below (a CPU, a
  target whose verify is dear, a drafter that never agrees), steps decode plainly and draft only every so often, to
  see whether speculation pays again: the interval starts where probing costs at most `PROBE_SHARE` of the decode
  time and doubles after each probe that leaves the gain there (up to `MAX_PROBE_INTERVAL`), and each request starts
  again from the shortest.
* **Which size this step takes** (fast): argmax_b of the expected rate, where size 0 while drafting costs a
  decode step plus the next draft, T(0) + draft.

The choice depends only on what happened before the step, never on the step's own target draws, so acceptance
stays lossless whatever sizes are chosen.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

PRIOR = 0.5  # pseudo-drafts added to both sides of c(b): a few steps cannot swing it far from 1
# Speculation must promise this much more than plain decoding before steps draft: the time of a size not taken
# lately is an older measurement, and the calibration lags what the drafts are accepting now.
MARGIN = 0.05
PROBE_SHARE = 0.01
MAX_PROBE_INTERVAL = 1024


class BudgetController:
    def __init__(self, sizes: Sequence[int], step_seconds: dict[int, float], draft_seconds: float = 0.0,
                 probe_every: int = 16, smoothing: float = 0.1) -> None:
        """sizes: the candidate sizes, 0 included; step_seconds: T(b) for each of them; draft_seconds: what one
        draft costs; probe_every: the shortest interval between probes."""
        if 0 not in sizes or set(step_seconds) != set(sizes):
            raise ValueError(f"sizes must include 0 and each needs a step time: {list(sizes)} vs {sorted(step_seconds)}")
        self.sizes = tuple(sorted(sizes))
        self.measured_seconds = dict(step_seconds)
        self.step_seconds = dict(step_seconds)
        self.draft_seconds = draft_seconds
        self.probe_every = max(probe_every, math.ceil(draft_seconds / (PROBE_SHARE * self.step_seconds[0])))
        self.smoothing = smoothing
        self._accepted: dict[int, float] = {}
        self._predicted: dict[int, float] = {}
        self._gain: float | None = None  # None until the first draft: speculate until shown otherwise
        self._first_verified = False  # the first draft was verified (see the module docstring)
        self._steps_since_draft = 0
        self._probe_interval = self.probe_every
        self.chosen: Counter[int] = Counter()

    @property
    def gain(self) -> float | None:
        """The smoothed best expected rate of the drafts so far over plain decoding's (None before any draft)."""
        return self._gain

    @property
    def speculating(self) -> bool:
        return self._gain is None or self._gain > 1.0 + MARGIN

    def forget(self) -> None:
        """Drop everything learned from steps (calibrations, the gain, the counts, realised step times): the
        state right after the decoder was built (the demo starts each timed pass from it, so a repeated pass
        starts from the same choices)."""
        self.step_seconds = dict(self.measured_seconds)
        self._accepted.clear()
        self._predicted.clear()
        self._gain = None
        self._first_verified = False
        self.chosen.clear()
        self.start_request()

    def start_request(self) -> None:
        """A new request probes at the shortest interval again (what it costs is bounded by `PROBE_SHARE`)."""
        self._probe_interval = self.probe_every
        self._steps_since_draft = 0

    def calibration(self, size: int) -> float:
        """c(size): realised over predicted accepted drafts (smoothed, and pulled towards 1 while both are small);
        a size not yet tried borrows the largest calibration of the sizes that were, else 1."""
        if size in self._predicted:
            return (self._accepted[size] + PRIOR) / (self._predicted[size] + PRIOR)
        return max((self.calibration(b) for b in self._predicted), default=1.0)

    def tokens_per_second(self, estimate: Sequence[float]) -> dict[int, float]:
        """Expected tokens per second of each size, given the draft's estimates (in `sizes` order), while drafting
        goes on: size 0 is a decode step followed by the next step's draft."""
        rates = {b: (1.0 + self.calibration(b) * e) / self.step_seconds[b] for b, e in zip(self.sizes, estimate)}
        rates[0] = 1.0 / (self.step_seconds[0] + self.draft_seconds)
        return rates

    def wants_draft(self) -> bool:
        """Whether the coming step should draft: always while speculation pays, else every `_probe_interval`-th
        step after the last draft."""
        return self.speculating or self._steps_since_draft + 1 >= self._probe_interval

    def choose(self, estimate: Sequence[float] | None) -> int:
        """The size of the coming step given a draft's estimates (None: no draft was made, so 0)."""
        if estimate is None:
            size = 0
            self._steps_since_draft += 1
        else:
            was_speculating = self.speculating
            rates = self.tokens_per_second(estimate)
            best = max((b for b in self.sizes if b), key=rates.__getitem__)
            sample = rates[best] * self.step_seconds[0]
            self._gain = sample if self._gain is None else self._gain + self.smoothing * (sample - self._gain)
            if not self._first_verified:  # nothing calibrated yet: verify this draft
                size, self._first_verified = best, True
            elif self.speculating:
                size = max(self.sizes, key=rates.__getitem__)
                self._probe_interval = self.probe_every
            else:  # the draft is paid and no draft follows: speculate only if it clearly beats a decode step
                size = best if sample > 1.0 + MARGIN else 0
                if not was_speculating:
                    self._probe_interval = min(2 * self._probe_interval, MAX_PROBE_INTERVAL)
            self._steps_since_draft = 0
        self.chosen[size] += 1
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

    def observe_seconds(self, size: int, seconds: float) -> None:
        """A step at `size` took `seconds` of wall time, the next step's draft included when it drafts (size 0:
        without any draft), so T(size) follows the current context. A step cannot run much faster than the
        start-up's fastest: a time under half of that (a draft's time subtracted from a step that overlapped it)
        counts as half."""
        seconds = max(seconds, 0.5 * self.measured_seconds[size])
        self.step_seconds[size] += self.smoothing * (seconds - self.step_seconds[size])
