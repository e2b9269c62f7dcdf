"""Projections: cuBLAS (whole, or in 2 / 4 column parts), cuBLASLt or the Triton skinny matmul for 1 … 128 rows, whichever measured fastest for that shape.

Tree verify (N = budget + 1 rows) and drafter blocks (16 rows) multiply a few rows by large weights, where
cuBLAS's GEMM tiles may stream the weights more slowly than its batch-1 GEMV does; and a decode step's one row
goes through cuBLAS's GEMV, which streamed 96 % of the copy-bandwidth floor where the TMA skinny tiles at 16
rows reached more (docs/PERFORMANCE.md), so it is timed too. Only code inside `skinny_projections()` (the
speculative step and the decode step, whose row counts are fixed) is considered, so prefills of short prompts
never pay for a choice. Which kernel runs is decided per exact (rows, N, K, dtype)
the first time the shape is seen outside a CUDA-graph capture (`MeasuredChoice`): cuBLAS, the same GEMM through
cuBLASLt (its own heuristic picks other tiles and split-K variants for few rows) and every Triton configuration
are timed and the fastest is kept for the process. DFLASH_TFM_SKINNY_GEMM=0 keeps cuBLAS everywhere.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F

from dflash_tfm.kernels.linear.skinny_matmul import MAX_ROWS, SkinnyConfig, candidate_configs, skinny_matmul
from dflash_tfm.layers.measured_choice import MeasuredChoice

MIN_WEIGHT_ELEMENTS = 1 << 22  # smaller weights are not a bandwidth question: cuBLAS
projection_choice = MeasuredChoice(default="cublas")
_configs: dict[str, SkinnyConfig] = {}
_active = False


def enabled() -> bool:
    return _active and os.environ.get("DFLASH_TFM_SKINNY_GEMM", "1") != "0"


@contextmanager
def skinny_projections() -> Iterator[None]:
    """Let projections inside this block use the measured choice (see the module docstring)."""
    global _active
    previous, _active = _active, True
    try:
        yield
    finally:
        _active = previous


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ weight[N, K]ᵀ``, like ``F.linear`` without bias."""
    rows = x.numel() // x.shape[-1]
    if not (x.is_cuda and 1 <= rows <= MAX_ROWS and weight.numel() >= MIN_WEIGHT_ELEMENTS and enabled()):
        return F.linear(x, weight)
    key = (rows, *weight.shape, x.dtype, weight.dtype, x.device)
    name = projection_choice.pick(key, lambda: _candidates(x, weight, rows))
    if name == "cublas":
        return F.linear(x, weight)
    if name in PARTS:
        return cublas_in_parts(x, weight, PARTS[name])
    return cublaslt_linear(x, weight) if name == "cublaslt" else skinny_matmul(x, weight, _configs[name])


PARTS = {"cublas/2": 2, "cublas/4": 4}  # candidate names of `cublas_in_parts`
MIN_PARTS_ROWS, MIN_PARTS_WIDTH = 17, 16384  # where they are timed: tree verify's row counts, wide weights


def cublas_in_parts(x: torch.Tensor, weight: torch.Tensor, parts: int) -> torch.Tensor:
    """``F.linear`` as `parts` cuBLAS GEMMs over equal row blocks of the weight, each writing its column slice
    of one output (no copies). cuBLAS picks its tiles by the output width, and at 65 rows the 34816-wide MLP
    gate_up streamed its weight ~10 % slower than the one-row GEMV did (docs/PERFORMANCE.md, session 16)."""
    N, K = weight.shape
    step = N // parts
    if N % parts or step % 8:  # every slice 16-byte aligned
        raise ValueError(f"cannot split {N} outputs into {parts} aligned parts")
    x2 = x.reshape(-1, K)
    out = torch.empty(x2.shape[0], N, dtype=x.dtype, device=x.device)
    for p in range(parts):
        torch.mm(x2, weight[p * step:(p + 1) * step].t(), out=out[:, p * step:(p + 1) * step])
    return out.view(*x.shape[:-1], N)


def cublaslt_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear`` dispatched to cuBLASLt (CUDA only: the preference is process-wide, so it is set for this call
    and restored; under a capture the graph keeps the cuBLASLt kernel)."""
    previous = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        return F.linear(x, weight)
    finally:
        torch.backends.cuda.preferred_blas_library(previous)


def _candidates(x: torch.Tensor, weight: torch.Tensor, rows: int) -> dict:
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    candidates: dict = {"cublas": lambda: F.linear(x, weight), "cublaslt": lambda: cublaslt_linear(x, weight)}
    if rows >= MIN_PARTS_ROWS and weight.shape[0] >= MIN_PARTS_WIDTH:
        for name, parts in PARTS.items():
            if weight.shape[0] % (8 * parts) == 0:
                candidates[name] = lambda parts=parts: cublas_in_parts(x, weight, parts)
    for config in candidate_configs(rows, weight.shape[0], weight.shape[1], sms):
        _configs[str(config)] = config
        candidates[str(config)] = lambda c=config: skinny_matmul(x, weight, c)
    return candidates
