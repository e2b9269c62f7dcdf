"""``y = x (weight · scale)ᵀ`` for few rows (1 … 256: a decode step, tree verify, drafter-sized blocks) with the
weight in FP8 and its block scales applied in the kernel: a weight stream that reads one byte per weight.

The design is `kernels/linear/skinny_matmul.py`'s: one program owns a ``BM × BN`` output tile and a slice of K,
split-K into an fp32 workspace summed in a fixed order by a second kernel (deterministic, identical in eager runs
and CUDA-graph replays, no atomics). The K step is the 128-wide scale block, so each step loads an FP8 tile
``[BN, 128]``, multiplies it by its rows' scales for this K block (``scale [N, ⌈K/128⌉]``, one per output row:
`block_quant`), rounds that to the activations' dtype and accumulates its product with x on the tensor cores in
fp32. One row (a decode step) can instead take the GEMV launch: the same weight stream multiplied on the CUDA
cores, several K blocks per loop step, each block's scale applied to its fp32 row sums.
Every launch allocates only its output (and the split workspace), so it is safe inside a CUDA-graph capture.

The twin is `reference.fp8_matmul_reference` (dequantise, then ``F.linear``): the tile launch rounds the
dequantised weight as the twin does, the GEMV keeps it in fp32.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dflash_tfm.kernels import use_triton
from dflash_tfm.kernels.fp8.block_quant import BLOCK
from dflash_tfm.kernels.fp8.reference import fp8_matmul_reference
from dflash_tfm.kernels.linear.skinny_matmul import block_m, sum_splits_kernel

MAX_ROWS = 256  # beyond this the weight is dequantised once and cuBLAS runs (prefill)
SHARED_MEMORY_BUDGET = 200 * 1024  # bytes of pipelined tiles per program (sm_90 has 228 KB)


@dataclass(frozen=True)
class Fp8StreamConfig:
    """One launch: ``gemv`` (one row only) multiplies on the CUDA cores and reads ``sub_blocks`` scale blocks of
    K per loop step; otherwise the tensor-core tile loop, one scale block per step."""
    block_n: int = 64
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    gemv: bool = False
    sub_blocks: int = 1


@triton.jit
def _fp8_matmul_kernel(
    x, w, s, out, M, N, K, k_per_split, sxm, sxk, swn, swk, ssn, ssk, som, son, sos,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
):
    """Grid (cdiv(N, BN), cdiv(M, BM), SPLIT_K). w FP8 [N, K]; s fp32 [N, cdiv(K, BK)]; out [SPLIT_K, M, N] fp32
    partials, or [M, N] when SPLIT_K = 1 (sos unused then). k_per_split is a multiple of BK."""
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    offs_m = tl.program_id(1) * BM + tl.arange(0, BM)
    split = tl.program_id(2)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    mm, nm = offs_m < M, offs_n < N
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        offs_k = k0 + tl.arange(0, BK)
        km = offs_k < k_hi
        a = tl.load(x + offs_m[:, None] * sxm + offs_k[None, :] * sxk, mask=mm[:, None] & km[None, :], other=0.0)
        b = tl.load(w + offs_n[None, :] * swn + offs_k[:, None] * swk, mask=nm[None, :] & km[:, None], other=0.0)
        scale = tl.load(s + offs_n * ssn + (k0 // BK) * ssk, mask=nm, other=0.0)
        # the tile dequantised to x's dtype (the twin's one rounding), so the tensor cores accumulate in place
        acc = tl.dot(a, (b.to(tl.float32) * scale[None, :]).to(a.dtype), acc, input_precision=PRECISION)
    tl.store(out + split * sos + offs_m[:, None] * som + offs_n[None, :] * son,
             acc.to(out.dtype.element_ty), mask=mm[:, None] & nm[None, :])


@triton.jit
def _fp8_gemv_kernel(
    x, w, s, out, N, K, k_per_split, sxk, swn, swk, ssn, ssk, sos,
    BN: tl.constexpr, BK: tl.constexpr, SUB: tl.constexpr,
):
    """One row: grid (cdiv(N, BN), SPLIT_K). Each loop step reads SUB scale blocks of 128 weights per output
    row (a [BN, 128] tile each, K contiguous), multiplies by x in fp32 on the CUDA cores and applies each block's
    scale to its row sums. out [SPLIT_K, N] (fp32 partials) or [N]; k_per_split is a multiple of SUB · BK."""
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    nm = offs_n < N
    split = tl.program_id(1)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros([BN], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, SUB * BK):
        for j in tl.static_range(SUB):
            offs_k = k0 + j * BK + tl.arange(0, BK)
            km = offs_k < k_hi
            xv = tl.load(x + offs_k * sxk, mask=km, other=0.0).to(tl.float32)
            wv = tl.load(w + offs_n[:, None] * swn + offs_k[None, :] * swk, mask=nm[:, None] & km[None, :],
                         other=0.0).to(tl.float32)
            scale = tl.load(s + offs_n * ssn + (k0 // BK + j) * ssk, mask=nm & (k0 + j * BK < k_hi), other=0.0)
            acc += tl.sum(wv * xv[None, :], axis=1) * scale
    tl.store(out + split * sos + offs_n, acc.to(out.dtype.element_ty), mask=nm)


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               config: Fp8StreamConfig | None = None) -> torch.Tensor:
    """``x [..., K] @ (weight · scale)ᵀ -> [..., N]`` in x's dtype with fp32 accumulation: weight FP8 [N, K], scale
    fp32 [N, ⌈K/128⌉] (on the CPU without Triton's interpreter: the twin)."""
    N, K = weight.shape
    if x.shape[-1] != K or scale.shape != (N, -(-K // BLOCK)):
        raise ValueError(f"x [..., {x.shape[-1]}], weight {list(weight.shape)} and scale {list(scale.shape)} "
                         f"do not fit (scale must be [N, ceil(K / {BLOCK})])")
    if not use_triton(x):
        return fp8_matmul_reference(x, weight, scale)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    BM = block_m(M)
    c = config or stream_config(M, N, K, multiprocessors(x.device))
    if c.gemv and M != 1:
        raise ValueError(f"the FP8 GEMV launch takes one row, got {M}")
    step = BLOCK * (c.sub_blocks if c.gemv else 1)
    k_per_split = triton.cdiv(triton.cdiv(K, c.split_k), step) * step
    splits = triton.cdiv(K, k_per_split)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    target = out if splits == 1 else torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    out_strides = (target.stride(-2), target.stride(-1), target.stride(0) if splits > 1 else 0)
    if c.gemv:
        _fp8_gemv_kernel[(triton.cdiv(N, c.block_n), splits)](
            x2, weight, scale, target, N, K, k_per_split, x2.stride(1), *weight.stride(), *scale.stride(),
            out_strides[2], BN=c.block_n, BK=BLOCK, SUB=c.sub_blocks, num_warps=c.num_warps, num_stages=c.num_stages)
    else:
        grid = (triton.cdiv(N, c.block_n), triton.cdiv(M, BM), splits)
        _fp8_matmul_kernel[grid](
            x2, weight, scale, target, M, N, K, k_per_split, *x2.stride(), *weight.stride(), *scale.stride(),
            *out_strides, BM=BM, BN=c.block_n, BK=BLOCK, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            num_warps=c.num_warps, num_stages=c.num_stages)
    if splits > 1:
        sum_splits_kernel[(triton.cdiv(M * N, 1024),)](target, out, M * N, SPLIT_K=splits, BLOCK=1024)
    return out.view(*lead, N)


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """The SM count the launches are sized for (1 off CUDA: Triton's interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


@dataclass(frozen=True)
class Fp8Launch:
    """A launch shape independent of the product's size: `stream_config` turns it into a config for M × N × K,
    with the split-K that gives about ``programs_per_sm`` programs per SM."""
    block_n: int
    programs_per_sm: int
    num_warps: int
    num_stages: int = 4
    gemv: bool = False
    sub_blocks: int = 1


# The candidates of the tuned launch choice (`layers/fp8_weight.py`), from the H100 sweep of every launch at the
# 27B projections (`benchmarks.bench_fp8_linear --sweep`, docs/PERFORMANCE.md): for one row the GEMV with narrow
# tiles and 512 K per step won on the wide projections, wider tiles and more splits on the 5120-wide ones; for
# 16 and 65 rows narrow tensor-core tiles with three stages.
DEFAULT_LAUNCH = "tiles n64"
LAUNCHES = {
    "tiles n64": Fp8Launch(64, 2, 4),
    "tiles n32": Fp8Launch(32, 2, 4, 3),
    "tiles n32 x1": Fp8Launch(32, 1, 4, 3),
    "tiles n128 w8": Fp8Launch(128, 2, 8, 3),
    "gemv n16 k4 w8": Fp8Launch(16, 4, 8, 2, gemv=True, sub_blocks=4),
    "gemv n32 k4": Fp8Launch(32, 4, 4, 2, gemv=True, sub_blocks=4),
    "gemv n64 k2 w8": Fp8Launch(64, 4, 8, 2, gemv=True, sub_blocks=2),
    "gemv n64 k1 w8": Fp8Launch(64, 4, 8, 2, gemv=True, sub_blocks=1),
}


def launches_for(rows: int) -> tuple[str, ...]:
    """The launches that can run ``rows`` rows (the GEMV takes one)."""
    return tuple(name for name, launch in LAUNCHES.items() if rows == 1 or not launch.gemv)


def stream_config(M: int, N: int, K: int, sms: int, launch: Fp8Launch = LAUNCHES[DEFAULT_LAUNCH]) -> Fp8StreamConfig:
    """The config of ``launch`` for an M × N × K product: the split-K nearest ``programs_per_sm`` programs per
    SM (each split keeping at least two loop steps) and, for the tile loop, at most ``num_stages`` pipeline
    stages, fewer where they do not fit the shared memory (16-bit x tile, 8-bit weight tile)."""
    step = BLOCK * launch.sub_blocks if launch.gemv else BLOCK
    tiles = triton.cdiv(N, launch.block_n) * (1 if launch.gemv else triton.cdiv(M, block_m(M)))
    split = max(1, min(K // (2 * step), round(launch.programs_per_sm * sms / tiles)))
    stages = launch.num_stages
    if not launch.gemv:
        stages = max(1, min(stages, SHARED_MEMORY_BUDGET // ((2 * block_m(M) + launch.block_n) * BLOCK)))
    return Fp8StreamConfig(launch.block_n, split, launch.num_warps, stages, launch.gemv, launch.sub_blocks)
