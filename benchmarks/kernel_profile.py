"""Kernels per step and CUDA time per kernel name of a step function, from torch.profiler (GPU scripts)."""
from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

KernelTotals = dict[str, list[float]]  # kernel name -> [launches, µs], summed over the profiled calls


def _profile_into(totals: KernelTotals, fn: Callable[[], object]) -> None:
    """Run `fn` once under the profiler and add its kernels' launches and device µs to `totals`."""
    cuda = torch.cuda.is_available()  # on a CPU-only machine: top-level CPU ops instead (a smoke run)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        fn()
        sync()
    for evt in prof.events():
        kernel = evt.device_type == torch.autograd.DeviceType.CUDA if cuda else evt.cpu_parent is None
        if kernel:
            totals[evt.name][0] += 1
            totals[evt.name][1] += evt.device_time_total if cuda else evt.cpu_time_total


def _print_totals(totals: KernelTotals, what: str, steps: int, top: int) -> None:
    total_n = sum(v[0] for v in totals.values()) / steps
    total_us = sum(v[1] for v in totals.values()) / steps
    print(f"{what}: {total_n:.0f} kernels per step, {total_us / 1e3:.3f} ms of kernel time per step")
    gemv = sum(v[1] for k, v in totals.items() if "gemv" in k.lower() or "gemm" in k.lower() or "sm90" in k) / steps
    print(f"  of which GEMV/GEMM kernels: {gemv / 1e3:.3f} ms")
    print("| kernel | per step | us per step |")
    print("|---|---|---|")
    for name, (n, us) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"| {name[:90]} | {n / steps:.0f} | {us / steps:.0f} |")


def print_kernel_table(step: Callable[[], object], what: str, steps: int = 3, top: int = 25) -> None:
    """Profile `steps` calls of an already warmed-up `step` and print the total and the `top` kernels by time."""
    totals: KernelTotals = defaultdict(lambda: [0, 0.0])
    _profile_into(totals, lambda: [step() for _ in range(steps)])
    _print_totals(totals, what, steps, top)


def print_phase_tables(phases: list[tuple[str, Callable[[], object]]], what: str, steps: int = 3,
                       top: int = 15) -> None:
    """Run `steps` rounds of the (already warmed-up) phases in order, profiling each phase on its own, and print
    one kernel table per phase: where a multi-phase step's time goes, when later phases depend on earlier ones."""
    totals: dict[str, KernelTotals] = {name: defaultdict(lambda: [0, 0.0]) for name, _ in phases}
    for _ in range(steps):
        for name, fn in phases:
            _profile_into(totals[name], fn)
    for name, _ in phases:
        _print_totals(totals[name], f"{what}, {name}", steps, top)
