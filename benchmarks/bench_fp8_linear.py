"""BF16 cuBLAS against the FP8 weight-stream kernel at Qwen3.6-27B projection shapes (GPU script).

For each projection (the lm_head stays BF16 in FP8 checkpoints, so it is not here) and row count: cuBLAS on the
BF16 weight, the Triton FP8 kernel (`kernels/fp8/weight_stream.py`, FP8 bytes + per-row scales streamed once),
and the prefill path (dequantise to BF16, then cuBLAS), each as a median of CUDA-event timings
(`benchmarks/timing.py`); GB/s counts the bytes of the weight (and scales) each variant must read. The FP8
floor is half the BF16 one, so the kernel's target is ≈ 2× cuBLAS at 1 and 16 rows.

`--sweep` times every launch configuration of the FP8 kernel (tile width, split-K, warps, pipeline stages; for
one row also the CUDA-core GEMV) per projection and row count, each call over its own copy of the weight taken
in turn from enough copies to overflow the L2 (as in a decode step, where every weight is read once), and prints
the best few: what the tuned launch choice's candidates are made of.

    python -m benchmarks.bench_fp8_linear [--rows 1 16 65] [--sweep] [--out results.json]
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from benchmarks.bench_projection_kernels import shapes
from benchmarks.timing import time_ms
from dflash_tfm.config import ModelConfig
from dflash_tfm.kernels.fp8.block_quant import dequantize_rows, expand_block_scales, quantize_blocks
from dflash_tfm.kernels.fp8.weight_stream import Fp8Launch, Fp8StreamConfig, fp8_matmul, stream_config
from dflash_tfm.models.presets import QWEN3_6_27B

ITERS, WARMUP = 50, 10
L2_OVERFLOW_BYTES = 256 << 20  # the weight copies one sweep timing cycles through: several times any GPU's L2


def sweep_configs(rows: int, N: int, K: int, sms: int) -> list[Fp8StreamConfig]:
    """Every launch tried: for one row the CUDA-core GEMV (tile width × 2 to 8 programs per SM × warps × stages ×
    K blocks per step), else the tensor-core tiles (width × 1 to 4 programs per SM × warps × stages), each
    sized for the product by `stream_config` as the engine sizes its launches."""
    if rows == 1:
        launches = [Fp8Launch(bn, per_sm, warps, stages, gemv=True, sub_blocks=sub) for bn, per_sm, warps, stages, sub
                    in itertools.product((16, 32, 64), (2, 4, 8), (4, 8), (2, 4), (1, 2, 4))]
    else:
        launches = [Fp8Launch(bn, per_sm, warps, stages) for bn, per_sm, warps, stages
                    in itertools.product((32, 64, 128, 256), (1, 2, 4), (4, 8), (2, 3, 4))]
    return list(dict.fromkeys(stream_config(rows, N, K, sms, launch) for launch in launches))


def sweep(args: argparse.Namespace, cfg: ModelConfig, dev: torch.device, dt: torch.dtype) -> list[dict]:
    """The `--sweep` table: per projection and row count, the best configurations by median time."""
    from triton.testing import do_bench_cudagraph

    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    found = []
    print("| rows | projection | N x K | best configurations: ms (GB/s) |\n|---|---|---|---|")
    for name, (N, K) in shapes(cfg).items():
        if name == "lm_head":
            continue
        q, block_scales = quantize_blocks(torch.randn(N, K, device=dev, dtype=dt) / K**0.5)
        scale = expand_block_scales(block_scales, N)
        nbytes = q.numel() + scale.numel() * 4
        copies = [(q.clone(), scale.clone()) for _ in range(max(1, L2_OVERFLOW_BYTES // nbytes))]
        for rows in args.rows:
            x = torch.randn(rows, K, device=dev, dtype=dt)
            timed = []
            for c in sweep_configs(rows, N, K, sms):
                def run(c=c) -> None:
                    for w, s in copies:
                        fp8_matmul(x, w, s, c)
                try:
                    ms = do_bench_cudagraph(run, rep=10, return_mode="median") / len(copies)
                except Exception as e:  # noqa: BLE001 — a launch that does not fit (shared memory) is skipped
                    print(f"  {c}: {type(e).__name__}", flush=True)
                    continue
                timed.append((ms, c))
            timed.sort(key=lambda t: t[0])
            default_ms = do_bench_cudagraph(lambda: [fp8_matmul(x, w, s) for w, s in copies], rep=20,
                                            return_mode="median") / len(copies)
            best = ", ".join(f"{c} {ms:.4f} ({nbytes / ms / 1e6:.0f})" for ms, c in timed[:3])
            print(f"| {rows} | {name} | {N} x {K} | default {default_ms:.4f} ({nbytes / default_ms / 1e6:.0f}); "
                  f"{best} |", flush=True)
            found.append(dict(rows=rows, projection=name, N=N, K=K, fp8_bytes=nbytes, default_ms=default_ms,
                              configs=[dict(ms=ms, **vars(c)) for ms, c in timed]))
        del copies
        torch.cuda.empty_cache()
    return found


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 65])
    ap.add_argument("--sweep", action="store_true", help="time every launch configuration of the FP8 kernel")
    ap.add_argument("--out", default=None, help="write the table as JSON here")
    args = ap.parse_args()
    cfg = ModelConfig.from_dict(QWEN3_6_27B)
    dev, dt = torch.device("cuda"), torch.bfloat16
    if args.sweep:
        found = sweep(args, cfg, dev, dt)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "sweep": found}, f, indent=1)
        return
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
