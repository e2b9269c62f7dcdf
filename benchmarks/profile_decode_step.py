"""Where the time of one autoregressive decode step goes (GPU script): kernels per step and CUDA time per
kernel name, from torch.profiler over eager steps of the Qwen3.6-27B-shaped random-weight target.

    python benchmarks/profile_decode_step.py [--layers 64] [--top 25]
"""
from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from dflash_tfm.config import ModelConfig
from dflash_tfm.engine.model_runner import ModelRunner
from dflash_tfm.loading.loader import build_model
from dflash_tfm.models.presets import QWEN3_6_27B
from dflash_tfm.models.random_init import init_random_


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    cfg = ModelConfig.from_dict({**QWEN3_6_27B, "num_hidden_layers": args.layers})
    model = init_random_(build_model(cfg, torch.device("cuda"), torch.bfloat16, max_positions=4096))
    runner = ModelRunner(model, max_len=2048, device=torch.device("cuda"), use_cuda_graph=False)
    token = torch.tensor([11], device="cuda")
    for pos in range(3):  # compile + warm up
        runner.decode(token, pos)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for pos in range(3, 3 + args.steps):
            runner.decode(token, pos)
        torch.cuda.synchronize()
    per_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            per_name[evt.name][0] += 1
            per_name[evt.name][1] += evt.device_time_total if hasattr(evt, "device_time_total") else evt.cuda_time_total
    steps = args.steps
    total_n = sum(v[0] for v in per_name.values()) / steps
    total_us = sum(v[1] for v in per_name.values()) / steps
    print(f"{args.layers} layers: {total_n:.0f} kernels per step, {total_us / 1e3:.2f} ms of kernel time per step")
    gemv = sum(v[1] for k, v in per_name.items() if "gemv" in k.lower() or "gemm" in k.lower() or "sm90" in k) / steps
    print(f"  of which GEMV/GEMM kernels: {gemv / 1e3:.2f} ms")
    print("| kernel | per step | us per step |")
    print("|---|---|---|")
    for name, (n, us) in sorted(per_name.items(), key=lambda kv: -kv[1][1])[: args.top]:
        print(f"| {name[:90]} | {n / steps:.0f} | {us / steps:.0f} |")


if __name__ == "__main__":
    main()
