"""Timing helpers shared by the benchmark scripts (CUDA events / graph replay, medians after warm-up; wall clock
for CPU check runs)."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from dflash_tfm import tuning


def time_ms(fn: Callable[[], object], iters: int, warmup: int = 0) -> float:
    """Median milliseconds of fn() measured with CUDA events, one event pair per call, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def wall_ms(fn: Callable[[], object], iters: int, warmup: int = 0) -> float:
    """Median wall-clock milliseconds of fn() after `warmup` calls: `time_ms` for a CPU run (which only checks
    that a script works)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def capture(fn: Callable[[], object], warmups: int = 2) -> tuple[torch.cuda.CUDAGraph, object]:
    """Warm fn up on a side stream (as CUDA graphs require), capture one call; returns (graph, its outputs)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def time_graph(fn: Callable[[int], object], layers: int, rep: int = 200) -> float:
    """Median µs per call of ``fn(layer)``, all ``layers`` calls captured in one CUDA graph (fn(0) runs once
    first, outside the capture, to compile and allocate)."""
    from triton.testing import do_bench

    fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(layers):
            fn(layer)
    return do_bench(graph.replay, warmup=25, rep=rep, return_mode="median") * 1e3 / layers


def report_choices(results: dict) -> None:
    """Print the tuned kernel choices of this GPU (each winner against the default or the runner-up, failures) and
    keep them in results["kernel_choices"] (operator -> shape -> chosen, every candidate's ms), so a candidate that
    lost shows by how much. Shapes the tuning cache already held were timed when it was made, not in this run."""
    device = torch.device("cuda")
    results["kernel_choices"] = tuning.report(device)
    lines = tuning.describe(device)
    print(f"{tuning.describe_kernel_path(device)}\ntuned choices ({len(lines)}):" + "".join(f"\n  {line}" for line in lines),
          flush=True)
