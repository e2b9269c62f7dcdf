"""Can the z (output-gate) projection stream its weight while the GDN tree solve runs? (GPU script, not a test.)

The tree solve is latency-bound (a few warps per SM, HBM almost idle for ~35 µs per layer), and a GDN layer's
z = x·W_zᵀ (65 rows × 5120 → 6144, 63 MB of bf16 weight) is needed only after it, by the gated norm. Over 48
layers, each with its own weight and 3 MiB state (nothing stays in L2), one CUDA graph per variant, median µs
per layer: the solve alone, the GEMM alone (cuBLAS; with an SM carve-out; Triton skinny tiles), the two in
sequence, and the two on forked streams (GEMM captured before or after the solve).

    python -m benchmarks.bench_mixer_overlap [--rows 65] [--carveouts 16 32 66]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.bench_tree_kernels import DK, DV, HV, gdn_inputs, tree
from benchmarks.timing import time_graph
from dflash_tfm.kernels import gdn_tree_verify
from dflash_tfm.kernels.linear.skinny_matmul import candidate_configs, skinny_matmul

LAYERS, HIDDEN, VALUE_DIM = 48, 5120, 6144


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=65)
    ap.add_argument("--carveouts", type=int, nargs="*", default=[16, 32, 66])
    args = ap.parse_args()
    torch.manual_seed(0)
    weights = [torch.randn(VALUE_DIM, HIDDEN, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
    x = torch.randn(args.rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
    parents, bits, _ = tree(65)
    inputs = gdn_inputs(65)
    states = [torch.randn(1, HV, DK, DV, device="cuda") * 0.1 for _ in range(LAYERS)]
    side = torch.cuda.Stream()
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def gdn(layer: int) -> None:
        i = inputs
        gdn_tree_verify(i["q"], i["k"], i["v"], i["g"], i["beta"], parents, states[layer], ancestors=bits)

    def forked(gemm, gemm_first: bool):
        def step(layer: int) -> None:
            side.wait_stream(torch.cuda.current_stream())
            if not gemm_first:
                gdn(layer)
            with torch.cuda.stream(side):
                gemm(layer)
            if gemm_first:
                gdn(layer)
            torch.cuda.current_stream().wait_stream(side)
        return step

    def show(name: str, us: float) -> None:
        print(f"| {name} | {us:.2f} |", flush=True)

    print(f"rows {args.rows}, {sms} SMs\n| variant | µs per layer |\n|---|---|")
    show("gdn", time_graph(gdn, LAYERS))
    gemms = {"cublas": lambda l: F.linear(x, weights[l])}
    for c in candidate_configs(args.rows, VALUE_DIM, HIDDEN, sms):
        gemms[str(c)] = lambda l, c=c: skinny_matmul(x, weights[l], c)
    for name, gemm in gemms.items():
        try:
            show(f"{name}", time_graph(gemm, LAYERS))
        except Exception as e:  # noqa: BLE001 — a config that does not compile is reported and skipped
            print(f"| {name} | failed: {type(e).__name__} |")
            continue
        show(f"gdn;{name}", time_graph(lambda l, g=gemm: (gdn(l), g(l)), LAYERS))
        show(f"gdn||{name} (gemm first)", time_graph(forked(gemm, True), LAYERS))
        show(f"gdn||{name} (gdn first)", time_graph(forked(gemm, False), LAYERS))
    setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
    if setter is None:
        print("no SM carve-out in this torch")
        return
    for carve in args.carveouts:
        setter(carve)
        for lib in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(lib)
            gemm = gemms["cublas"]
            show(f"{lib} carveout {carve}", time_graph(gemm, LAYERS))
            show(f"gdn||{lib} carveout {carve} (gemm first)", time_graph(forked(gemm, True), LAYERS))
            show(f"gdn||{lib} carveout {carve} (gdn first)", time_graph(forked(gemm, False), LAYERS))
        setter(None)
        torch.backends.cuda.preferred_blas_library("cublas")


if __name__ == "__main__":
    main()
