"""Choosing between equivalent implementations by timing them on the real tensors, once per shape.

Which kernel is fastest for a projection with 65 rows, or for attention over a 2k-slot cache, depends on the
GPU and the shapes; rather than guess, the first call for a key outside a CUDA-graph capture times every
candidate on the caller's actual tensors and the winner is kept for the process. Inside a capture nothing can
be timed, so an unseen key runs the default without deciding; the engine warms every shape up before capturing
it, so captured graphs hold the measured choice.

Candidates are timed the way the engine runs them, replayed from a CUDA graph
(`triton.testing.do_bench_cudagraph`): timed eagerly, a candidate of three launches (a compiled element-wise
op + cuBLAS + its split-K reduction) pays Python launch overhead that a graph does not, and lost on the H200
to a fused kernel that was 15 % slower inside the graph. A candidate must also beat the default by
`MIN_GAIN`, so kernels that are equally fast do not flip from one process to the next.
"""
from __future__ import annotations

from typing import Callable, Hashable

import torch

MIN_GAIN = 0.02  # a candidate replaces the default only when at least 2 % faster


class MeasuredChoice:
    def __init__(self, default: str) -> None:
        self.default = default
        self.choices: dict[Hashable, str] = {}
        self.failures: dict[Hashable, dict[str, str]] = {}
        self.timings: dict[Hashable, dict[str, float]] = {}  # ms per candidate, as timed

    def pick(self, key: Hashable, candidates: Callable[[], dict[str, Callable[[], object]]],
             can_time: bool = True) -> str:
        """The name of the fastest candidate for `key` (timed now if unseen), or the default during a capture
        or when the caller's tensors cannot be timed (`can_time=False`: not on CUDA; a choice already recorded
        for the key, e.g. set by a test, still applies). `candidates()` builds the name -> callable map; it is
        only called when there is something to time. A candidate that raises while being timed (a kernel that
        does not compile on this GPU, say) is left out and its error kept in `failures`; the default must work."""
        if key not in self.choices:
            if not can_time or torch.cuda.is_current_stream_capturing():
                return self.default
            from triton.testing import do_bench_cudagraph

            times = {}
            for name, fn in candidates().items():
                try:
                    times[name] = do_bench_cudagraph(fn, rep=20, return_mode="median")
                except Exception as e:  # noqa: BLE001 — any failure just disqualifies the candidate
                    if name == self.default:
                        raise
                    self.failures.setdefault(key, {})[name] = f"{type(e).__name__}: {e}"[:300]
            self.timings[key] = times
            best = min(times, key=times.get)
            self.choices[key] = best if times[best] < (1 - MIN_GAIN) * times[self.default] else self.default
        return self.choices[key]

    def report(self) -> dict[str, dict]:
        """Per timed key: the choice, every candidate's time (ms) and any candidate's failure — what a benchmark
        prints, so a candidate that lost (or broke) shows by how much (or why)."""
        return {str(key): {"chosen": self.choices[key], "ms": {n: round(t, 4) for n, t in self.timings[key].items()},
                           **({"failed": self.failures[key]} if key in self.failures else {})}
                for key in self.timings}

    def describe(self) -> list[str]:
        """One line per timed key for a benchmark's log: the choice and its time against the default's, the
        runner-up, and the names of candidates that failed."""
        lines = []
        for key, times in self.timings.items():
            chosen = self.choices[key]
            runner_up = min((n for n in times if n != chosen), key=times.get, default=None)
            line = f"{key}: {chosen} {times[chosen]:.4f} ms"
            if chosen != self.default:
                line += f" (default {self.default} {times[self.default]:.4f} ms)"
            elif runner_up is not None:
                line += f" (best other {runner_up} {times[runner_up]:.4f} ms)"
            if key in self.failures:
                line += f"; failed: {', '.join(self.failures[key])}"
            lines.append(line)
        return lines
