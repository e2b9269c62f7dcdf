"""Projections: cuBLAS, cuBLAS in two column parts, cuBLASLt or the Triton skinny matmul, tuned per shape.

Tree verify (N = budget + 1 rows) and drafter blocks (16 rows) multiply a few rows by large weights, where
cuBLAS's GEMM tiles may stream the weights more slowly than its batch-1 GEMV does, and a decode step's one row
goes through cuBLAS's GEMV, which streams ~96 % of the copy-bandwidth floor. Which kernel is fastest truly
differs by shape and GPU, so it is a tuned choice (`dflash_tfm.tuning`: timed once per GPU model and shape,
kept in the tuning cache). Only code inside `skinny_projections()` (the speculative step and the decode step,
whose row counts are fixed) is considered, so prefills of short prompts never pay for a choice.

The candidates are those that won a shape in the recorded H200 runs (docs/PERFORMANCE.md, docs/data/*.json):
cuBLAS, the default, everywhere else; the same GEMM through cuBLASLt for the MLP down projection at 65 rows
(0.046 against 0.053 ms); cuBLAS in two column parts for the 34816-wide gate_up at 65 rows (0.0935 against
0.097 ms: cuBLAS picks its tiles by the output width); three Triton skinny tiles at up to 16 rows (`SKINNY`:
the down projection 6–9 % and the lm_head 5–9 % under cuBLAS, gate_up at 16 rows, the drafter's narrow
projection). Triton tiles never won at 65 rows (30 % or more behind cuBLAS), nor did splitting a GEMM in four.
"""
from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from dflash_tfm.kernels.linear.skinny_matmul import MAX_ROWS, SkinnyConfig, skinny_matmul, tile_config
from dflash_tfm.layers.fp8_weight import Fp8Weight, fp8_linear
from dflash_tfm.tuning import TunedChoice

MIN_WEIGHT_ELEMENTS = 1 << 22  # smaller weights are not a bandwidth question: cuBLAS
SKINNY = {"skinny n64 k128": (64, 128), "skinny n64 k256": (64, 256), "skinny n128 k128": (128, 128)}
MAX_SKINNY_ROWS = 16  # one row tile of the skinny kernel
MIN_PARTS_ROWS, MIN_PARTS_WIDTH = 17, 16384  # where two column parts are timed: tree verify's rows, wide weights
PROJECTION = TunedChoice("projection", default="cublas", candidates=("cublas", "cublaslt", "cublas/2", *SKINNY))
_active = False
_deferred = False


def projection_weight(*shape: int) -> nn.Parameter:
    """A projection's weight, uninitialised, in the default dtype and device; on the meta device inside
    `deferred_projection_weights()`."""
    return nn.Parameter(torch.empty(*shape, device="meta" if _deferred else None))


@contextmanager
def deferred_projection_weights() -> Iterator[None]:
    """Create projection weights on the meta device inside this block. A loader builds the model so, then allocates
    each projection in the format its checkpoint holds (BF16, or FP8 with scales: `loading/fp8_layout.py`), so an
    FP8 model never allocates the BF16 copy of its projections."""
    global _deferred
    previous, _deferred = _deferred, True
    try:
        yield
    finally:
        _deferred = previous


@contextmanager
def skinny_projections() -> Iterator[None]:
    """Let projections inside this block take the tuned kernel (see the module docstring)."""
    global _active
    previous, _active = _active, True
    try:
        yield
    finally:
        _active = previous


def linear(x: torch.Tensor, weight: torch.Tensor | Fp8Weight) -> torch.Tensor:
    """``x [..., K] @ weight[N, K]ᵀ``, like ``F.linear`` without bias; an FP8 weight takes its own kernels
    (`layers/fp8_weight.py`)."""
    if isinstance(weight, Fp8Weight):
        return fp8_linear(x, weight)
    rows = x.numel() // x.shape[-1]
    if not (_active and x.is_cuda and 1 <= rows <= MAX_ROWS and weight.numel() >= MIN_WEIGHT_ELEMENTS):
        if x.dim() > 2 and not x.is_cuda:
            # as rows: a batched input can go through bmm, which on a CPU may copy the whole weight per call
            # (the drafter's block slice through the bf16 [V, H] lm_head: 40 ms of a 60 ms draft)
            return F.linear(x.reshape(rows, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[0])
        return F.linear(x, weight)
    key = (rows, *weight.shape, x.dtype, weight.dtype)
    name = PROJECTION.pick(key, lambda: {n: functools.partial(fn, x, weight) for n, fn in candidates(rows, weight)},
                           x.device)
    return implementation(name)(x, weight)


def candidates(rows: int, weight: torch.Tensor) -> list[tuple[str, Callable]]:
    """The (name, implementation) pairs timed for ``rows`` rows times ``weight``."""
    found = [(n, implementation(n)) for n in ("cublas", "cublaslt")]
    if rows >= MIN_PARTS_ROWS and weight.shape[0] >= MIN_PARTS_WIDTH and weight.shape[0] % 16 == 0:
        found.append(("cublas/2", implementation("cublas/2")))
    if rows <= MAX_SKINNY_ROWS:
        found += [(n, implementation(n)) for n in SKINNY]
    return found


def implementation(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if name == "cublas":
        return F.linear
    if name == "cublaslt":
        return cublaslt_linear
    if name == "cublas/2":
        return functools.partial(cublas_in_parts, parts=2)
    return functools.partial(skinny_linear, tile=SKINNY[name])


def cublas_in_parts(x: torch.Tensor, weight: torch.Tensor, parts: int) -> torch.Tensor:
    """``F.linear`` as `parts` cuBLAS GEMMs over equal row blocks of the weight, each writing its column slice
    of one output (no copies). cuBLAS picks its tiles by the output width, and at 65 rows the 34816-wide MLP
    gate_up streamed its weight ~10 % slower than the one-row GEMV did (docs/PERFORMANCE.md, tree verification)."""
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


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """The Triton skinny matmul with a ``(block_n, block_k)`` tile, its split-K and stages set for the shape; the
    tiles load through TMA where the GPU has it (sm_90 on), which was as fast or faster at every shape timed."""
    return skinny_matmul(x, weight, _skinny_config(x.numel() // x.shape[-1], *weight.shape, *tile, x.device))


@functools.lru_cache(maxsize=None)
def _skinny_config(rows: int, N: int, K: int, block_n: int, block_k: int, device: torch.device) -> SkinnyConfig:
    props = torch.cuda.get_device_properties(device)
    return tile_config(rows, N, K, block_n, block_k, props.multi_processor_count, tma=props.major >= 9)
