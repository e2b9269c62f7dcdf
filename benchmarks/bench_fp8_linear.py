"""BF16 cuBLAS against the FP8 weight-stream kernel at Qwen3.6-27B projection shapes (GPU script).

For each projection (the lm_head stays BF16 in FP8 checkpoints, so it is not here) and row count: cuBLAS on the
BF16 weight, the Triton FP8 kernel (`kernels/fp8/weight_stream.py`, FP8 bytes + per-row scales streamed once),
and the prefill path (dequantise to BF16, then cuBLAS), each as a median of CUDA-event timings
(`benchmarks/timing.py`); GB/s counts the bytes of the weight (and scales) each variant must read. The FP8
floor is half the BF16 one, so the kernel's target is ≈ 2× cuBLAS at 1 and 16 rows.

    python -m benchmarks.bench_fp8_linear [--rows 1 16 65] [--out results.json]
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from benchmarks.bench_projection_kernels import shapes
from benchmarks.timing import time_ms
from dflash_tfm.config import ModelConfig
from dflash_tfm.kernels.fp8.block_quant import dequantize_rows, expand_block_scales, quantize_blocks
from dflash_tfm.kernels.fp8.weight_stream import fp8_matmul
from dflash_tfm.models.presets import QWEN3_6_27B

ITERS, WARMUP = 50, 10


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 65])
    ap.add_argument("--out", default=None, help="write the table as JSON here")
    args = ap.parse_args()
    cfg = ModelConfig.from_dict(QWEN3_6_27B)
    dev, dt = torch.device("cuda"), torch.bfloat16
    print(f"{torch.cuda.get_device_name()}; median ms of {ITERS} CUDA-event timings; GB/s = weight bytes / time\n")
    print("| rows | projection | N x K | BF16 cuBLAS ms (GB/s) | FP8 kernel ms (GB/s) | dequant + cuBLAS ms | "
          "speed-up |")
    print("|---|---|---|---|---|---|---|")
    results = []
    for name, (N, K) in shapes(cfg).items():
        if name == "lm_head":
            continue
        w = torch.randn(N, K, device=dev, dtype=dt) / K**0.5
        q, block_scales = quantize_blocks(w)
        scale = expand_block_scales(block_scales, N)
        bf16_bytes, fp8_bytes = w.numel() * 2, q.numel() + scale.numel() * 4
        for rows in args.rows:
            x = torch.randn(rows, K, device=dev, dtype=dt)
            cublas = time_ms(lambda: F.linear(x, w), ITERS, WARMUP)
            kernel = time_ms(lambda: fp8_matmul(x, q, scale), ITERS, WARMUP)
            dequant = time_ms(lambda: F.linear(x, dequantize_rows(q, scale, dt)), ITERS, WARMUP)
            gbs = lambda nbytes, ms: nbytes / ms / 1e6  # noqa: E731
            print(f"| {rows} | {name} | {N} x {K} | {cublas:.4f} ({gbs(bf16_bytes, cublas):.0f}) | "
                  f"{kernel:.4f} ({gbs(fp8_bytes, kernel):.0f}) | {dequant:.4f} | {cublas / kernel:.2f}x |", flush=True)
            results.append(dict(rows=rows, projection=name, N=N, K=K, cublas_ms=cublas, fp8_kernel_ms=kernel,
                                dequant_cublas_ms=dequant, bf16_bytes=bf16_bytes, fp8_bytes=fp8_bytes))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
