"""The adaptive speculation budget: before each step, the proposal size that maximises expected tokens per second.

Every candidate size b (drafts verified below the root; 0 is a plain decode step that drafts nothing) has a step
time T(b), measured on this machine when the decoder is built (`SpeculativeDecoder.measure_step_times`) and
then followed by the wall time of the steps taken at that size (`observe_seconds`, smoothed): a step's draft and
verify grow with the context, and a request's context is not the short one the start-up measured. A step of size
b > 0 includes the next step's draft, a plain decode step does not. Each draft gives, for every size at
once, the drafter-side estimate E(b) of the drafts the target would accept (`spec.acceptance_estimate`). Drafters
are not calibrated and Weaver's trees accept more than the marginals' best-first tree, so each size's estimate is
scaled by c(b) = EMA(accepted) / EMA(E(b)) over the steps taken at that size, shrunk towards the mean of the
sizes taken by `SHRINK_STEPS` pseudo-steps (a few unlucky steps must not rule a size out for good). A size never
taken borrows the largest calibration of the sizes taken: an optimistic guess is corrected by the steps that take
the size, a pessimistic one never would be, since a size that looks too poor to take stays untaken. For the same
reason the first draft is always verified: before any size is calibrated, the estimates alone tend to undervalue
trees against a plain decode step.

Each draft's expected rate of every size, (1 + c(b) E(b)) / T(b), is smoothed over the drafts (a plain mean over
the first ones, then an EMA) into R(b). Three decisions follow, on two time scales:

* **Which size** (slow): b* = argmax_b R(b). One draft's estimates are too noisy to pick among sizes: replaying
  the per-step argmax on recorded SmolLM2 steps (`acceptance_estimate`'s estimates against each size's exact
  acceptance) lost a fifth of the throughput of a fixed budget; the smoothed choice matched the best fixed one.
* **Whether to keep drafting** (slow). The *gain* of speculation is R(b*) T(0), relative to plain decoding.
  While it exceeds 1 + `MARGIN` (room for older step times and a lagging calibration), or fewer than
  `MIN_DRAFTS` drafts were seen, every step drafts: a response's first tokens are often hard, and one poor first
  estimate must not decide for the whole machine. Once the gain falls to 1 + `MARGIN` or below (a CPU, a target
  whose verify is dear, a drafter that never agrees), steps decode plainly and draft only every so often, to see
  whether speculation pays again: the interval starts where probing costs at most `PROBE_SHARE` of the decode
  time and doubles after each probe that leaves the gain there (up to `MAX_PROBE_INTERVAL`), and each request
  starts again from the shortest.
* **Whether this step verifies** (fast): size b* unless this draft's own rate at b* is below that of a decode
  step while drafting goes on, 1 / (T(0) + draft): then size 0, a plain decode step (a hard token). Drafting goes
  on either way: without drafts there would be no estimate to resume from.

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
MIN_DRAFTS = 16
SHRINK_STEPS = 4
PROBE_SHARE = 0.01
MAX_PROBE_INTERVAL = 1024
MAX_STEP_TIME_RATIO = 2.0  # one step's wall time counts as at most this many times its size's current T(b)


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
        self._steps_at: dict[int, int] = {}  # steps taken at each size (capped at the EMA's horizon)
        self._rates: dict[int, float] = {}  # R(b): each size's expected rate, smoothed over the drafts
        self._gain: float | None = None  # None until the first draft: speculate until shown otherwise
        self._drafts = 0  # drafts seen since construction (or `forget`)
        self._first_verified = False  # the first draft was verified (see the module docstring)
        self._steps_since_draft = 0
        self._probe_interval = self.probe_every
        self.chosen: Counter[int] = Counter()

    @property
    def gain(self) -> float | None:
        """The best smoothed expected rate R(b*) over plain decoding's (None before any draft)."""
        return self._gain

    @property
    def speculating(self) -> bool:
        return self._drafts < MIN_DRAFTS or self._gain > 1.0 + MARGIN

    def forget(self) -> None:
        """Drop everything learned from steps (calibrations, the gain, the counts, realised step times): the
        state right after the decoder was built (the demo starts each timed pass from it, so a repeated pass
        starts from the same choices)."""
        self.step_seconds = dict(self.measured_seconds)
        self._accepted.clear()
        self._predicted.clear()
        self._steps_at.clear()
        self._rates.clear()
        self._gain = None
        self._drafts = 0
        self._first_verified = False
        self.chosen.clear()
        self.start_request()

    def start_request(self) -> None:
        """A new request probes at the shortest interval again (what it costs is bounded by `PROBE_SHARE`)."""
        self._probe_interval = self.probe_every
        self._steps_since_draft = 0

    def calibrations(self) -> dict[int, float]:
        """c(b) of every size: realised over predicted accepted drafts at that size (smoothed, and pulled towards
        1 while both are small), shrunk towards the step-weighted mean of every tried size's by `SHRINK_STEPS`
        pseudo-steps, so a few unlucky steps cannot rule a size out for good; a size not yet tried borrows the
        largest calibration of the sizes that were, else 1."""
        if not self._steps_at:
            return dict.fromkeys(self.sizes, 1.0)
        own = {b: (self._accepted[b] + PRIOR) / (self._predicted[b] + PRIOR) for b in self._steps_at}
        pooled = sum(n * own[b] for b, n in self._steps_at.items()) / sum(self._steps_at.values())
        tried = {b: (n * own[b] + SHRINK_STEPS * pooled) / (n + SHRINK_STEPS) for b, n in self._steps_at.items()}
        borrowed = max(tried.values())
        return {b: tried.get(b, borrowed) for b in self.sizes}

    def calibration(self, size: int) -> float:
        """c(size) (see `calibrations`)."""
        return self.calibrations()[size]

    def tokens_per_second(self, estimate: Sequence[float]) -> dict[int, float]:
        """Expected tokens per second of each size, given the draft's estimates (in `sizes` order), while drafting
        goes on: size 0 is a decode step followed by the next step's draft."""
        c = self.calibrations()
        rates = {b: (1.0 + c[b] * e) / self.step_seconds[b] for b, e in zip(self.sizes, estimate)}
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
            self._drafts += 1
            weight = max(self.smoothing, 1.0 / self._drafts)  # a mean until the EMA's horizon is reached
            for b in self.sizes[1:]:
                self._rates[b] = self._rates.get(b, rates[b]) + weight * (rates[b] - self._rates.get(b, rates[b]))
            best = max(self.sizes[1:], key=self._rates.__getitem__)
            self._gain = self._rates[best] * self.step_seconds[0]
            if not self._first_verified:  # nothing calibrated yet: verify this draft
                size, self._first_verified = best, True
            elif self.speculating:
                size = best if rates[best] >= rates[0] else 0
                self._probe_interval = self.probe_every
            else:  # the draft is paid and no draft follows: speculate only if it clearly beats a decode step
                size = best if rates[best] * self.step_seconds[0] > 1.0 + MARGIN else 0
                if not was_speculating:
                    self._probe_interval = min(2 * self._probe_interval, MAX_PROBE_INTERVAL)
            self._steps_since_draft = 0
        self.chosen[size] += 1
        return size

    def observe(self, size: int, predicted: float, accepted: int) -> None:
        """A step at `size` whose estimate was `predicted` accepted `accepted` drafts."""
        if size == 0:
            return
        n = self._steps_at[size] = min(self._steps_at.get(size, 0) + 1, round(1 / self.smoothing))
        a = max(self.smoothing, 1.0 / n)  # a mean of the first steps, then the EMA
        self._accepted[size] = self._accepted.get(size, 0.0) + a * (accepted - self._accepted.get(size, 0.0))
        self._predicted[size] = self._predicted.get(size, 0.0) + a * (predicted - self._predicted.get(size, 0.0))

    def observe_seconds(self, size: int, seconds: float) -> None:
        """A step at `size` took `seconds` of wall time, the next step's draft included when it drafts (size 0:
        without any draft), so T(size) follows the current context. A step cannot run much faster than the
        start-up's fastest: a time under half of that (a draft's time subtracted from a step that overlapped it)
        counts as half. Nor does one step say a size got much dearer: a time over `MAX_STEP_TIME_RATIO` times the
        current T(size) counts as that. A context grows a step's time by a little per step, while a one-off stall
        (a CUDA graph captured for a new context bucket, a tuned kernel timed, a garbage collection) can cost a
        hundred steps' time: counted in full it made the size look too dear to take again, and a size not taken
        never has its time corrected (most likely why the batched SmolLM2 engine hardly speculated on an H100)."""
        seconds = min(max(seconds, 0.5 * self.measured_seconds[size]), MAX_STEP_TIME_RATIO * self.step_seconds[size])
        self.step_seconds[size] += self.smoothing * (seconds - self.step_seconds[size])
