"""Choosing between equivalent implementations by timing them on the real tensors, once per shape.

Which kernel is fastest for a projection with 65 rows, or for attention over a 2k-slot cache, depends on the
GPU and the shapes; rather than guess, the first call for a key outside a CUDA-graph capture times every
candidate (`triton.testing.do_bench`, on the caller's actual tensors) and the winner is kept for the process.
Inside a capture nothing can be timed, so an unseen key runs the default without deciding; the engine warms
every shape up before capturing it, so captured graphs hold the measured choice.
"""
from __future__ import annotations

from typing import Callable, Hashable

import torch


class MeasuredChoice:
    def __init__(self, default: str) -> None:
        self.default = default
        self.choices: dict[Hashable, str] = {}
        self.failures: dict[Hashable, dict[str, str]] = {}

    def pick(self, key: Hashable, candidates: Callable[[], dict[str, Callable[[], object]]]) -> str:
        """The name of the fastest candidate for `key` (timed now if unseen), or the default during a capture.
        `candidates()` builds the name -> callable map; it is only called when there is something to time.
        A candidate that raises while being timed (a kernel that does not compile on this GPU, say) is left
        out and its error kept in `failures`; the default must work."""
        if key not in self.choices:
            if torch.cuda.is_current_stream_capturing():
                return self.default
            from triton.testing import do_bench

            times = {}
            for name, fn in candidates().items():
                try:
                    times[name] = do_bench(fn, warmup=5, rep=20)
                except Exception as e:  # noqa: BLE001 — any failure just disqualifies the candidate
                    if name == self.default:
                        raise
                    self.failures.setdefault(key, {})[name] = f"{type(e).__name__}: {e}"[:300]
            self.choices[key] = min(times, key=times.get)
        return self.choices[key]
