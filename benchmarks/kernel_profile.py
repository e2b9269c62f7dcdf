"""Kernels per step and CUDA time per kernel name of a step function, from torch.profiler (GPU scripts)."""
from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile


def print_kernel_table(step: Callable[[], object], what: str, steps: int = 3, top: int = 25) -> None:
    """Profile `steps` calls of an already warmed-up `step` and print the total and the `top` kernels by time."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    per_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            per_name[evt.name][0] += 1
            per_name[evt.name][1] += evt.device_time_total if hasattr(evt, "device_time_total") else evt.cuda_time_total
    total_n = sum(v[0] for v in per_name.values()) / steps
    total_us = sum(v[1] for v in per_name.values()) / steps
    print(f"{what}: {total_n:.0f} kernels per step, {total_us / 1e3:.3f} ms of kernel time per step")
    gemv = sum(v[1] for k, v in per_name.items() if "gemv" in k.lower() or "gemm" in k.lower() or "sm90" in k) / steps
    print(f"  of which GEMV/GEMM kernels: {gemv / 1e3:.3f} ms")
    print("| kernel | per step | us per step |")
    print("|---|---|---|")
    for name, (n, us) in sorted(per_name.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"| {name[:90]} | {n / steps:.0f} | {us / steps:.0f} |")
