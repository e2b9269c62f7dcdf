"""Per-phase step timings (draft / tree / verify / commit) without a host sync inside the step.

On CUDA each phase is bracketed by events and the elapsed times are read once, when the request ends;
on the CPU the wall clock is exact because execution is synchronous.
"""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Callable, Iterator

import torch


def fastest_seconds(run: Callable[[], object], warmup: int, steps: int, device: torch.device) -> float:
    """The fastest of `steps` timed calls of `run` after `warmup` untimed ones, each from an idle GPU to its end
    (inf when steps is 0): the minimum, since other work on the machine only ever adds time."""
    cuda = device.type == "cuda"
    for _ in range(warmup):
        run()
    fastest = float("inf")
    for _ in range(steps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        if cuda:
            torch.cuda.synchronize()
        fastest = min(fastest, time.perf_counter() - start)
    return fastest


class PhaseTimer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._events: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = defaultdict(list)
        self._calls: dict[str, list[float]] = defaultdict(list)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events[name].append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._calls[name].append(time.perf_counter() - t0)

    def collect_calls(self) -> dict[str, list[float]]:
        """Seconds of every call of each phase since the last collect, in order (synchronises with the recorded
        events once)."""
        for name, pairs in self._events.items():
            for start, end in pairs:
                end.synchronize()
                self._calls[name].append(start.elapsed_time(end) / 1e3)
        self._events.clear()
        out = dict(self._calls)
        self._calls.clear()
        return out

    def collect(self) -> dict[str, float]:
        """Seconds per phase since the last collect."""
        return {name: sum(calls) for name, calls in self.collect_calls().items()}
