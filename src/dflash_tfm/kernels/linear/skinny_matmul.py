"""``y = x Wᵀ`` for few rows (2 … 256: tree verify, drafter blocks) and large weights, in Triton.

At these sizes a projection is a weight stream: each weight byte is used M times, far below what the tensor
cores could do with it, so the kernel's only job is to keep enough weight bytes in flight. One program owns a
``BM × BN`` output tile and a slice of K (split-K when N alone gives too few programs to fill the GPU); the
split partials go to an fp32 workspace ``[SPLIT_K, M, N]`` and a second kernel sums them in a fixed order, so
results are deterministic (no atomics) and identical between eager runs and CUDA-graph replays. A configuration
with ``tma`` loads both tiles through host-made tensor descriptors (Hopper's TMA engine: no address arithmetic
or masks in the loop, out-of-bounds reads are zeros), when the operands are contiguous and 16-byte aligned.
The twin is ``F.linear``. Whether it or cuBLAS runs for a shape is a tuned choice (``layers/linear.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from dflash_tfm.kernels import use_triton


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    tma: bool = False


@triton.jit
def _skinny_matmul_kernel(
    x, w, out, M, N, K, k_per_split, sxm, sxk, swn, swk, som, son, sos,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    """Grid (cdiv(N, BN), cdiv(M, BM), SPLIT_K). out is [SPLIT_K, M, N] (fp32 partials) or [M, N] when
    SPLIT_K = 1 (sos unused then)."""
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
        acc += tl.dot(a, b)
    tl.store(out + split * sos + offs_m[:, None] * som + offs_n[None, :] * son,
             acc.to(out.dtype.element_ty), mask=mm[:, None] & nm[None, :])


@triton.jit
def _skinny_matmul_tma_kernel(
    x_desc, w_desc, out, M, N, K, k_per_split, som, son, sos,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    """``_skinny_matmul_kernel`` with the x [M, K] and w [N, K] tiles loaded through tensor descriptors."""
    n0 = tl.program_id(0) * BN
    m0 = tl.program_id(1) * BM
    split = tl.program_id(2)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):  # k_per_split is a multiple of BK: a tile never crosses into the next split
        acc += tl.dot(x_desc.load([m0, k0]), w_desc.load([n0, k0]).T)
    offs_m = m0 + tl.arange(0, BM)
    offs_n = n0 + tl.arange(0, BN)
    tl.store(out + split * sos + offs_m[:, None] * som + offs_n[None, :] * son, acc.to(out.dtype.element_ty),
             mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


@triton.jit
def sum_splits_kernel(part, out, MN, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """out[i] = Σ_s part[s, i] over the flattened [M, N], in split order."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < MN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part + s * MN + offs, mask=m, other=0.0)
    tl.store(out + offs, acc.to(out.dtype.element_ty), mask=m)


def skinny_matmul(x: torch.Tensor, weight: torch.Tensor, config: SkinnyConfig = SkinnyConfig()) -> torch.Tensor:
    """``x [..., K] @ weight[N, K]ᵀ -> [..., N]`` in x's dtype with fp32 accumulation (on the CPU without
    Triton's interpreter: ``F.linear``)."""
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features, weight expects {weight.shape[1]}")
    if not use_triton(x):
        return F.linear(x, weight)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    M, K = x2.shape
    N = weight.shape[0]
    BM = block_m(M)
    c = config
    k_per_split = triton.cdiv(triton.cdiv(K, c.split_k), c.block_k) * c.block_k
    splits = triton.cdiv(K, k_per_split)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    target = out if splits == 1 else torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(N, c.block_n), triton.cdiv(M, BM), splits)
    out_strides = (target.stride(-2), target.stride(-1), target.stride(0) if splits > 1 else 0)
    if c.tma and tma_ready(x2, weight):
        _skinny_matmul_tma_kernel[grid](
            TensorDescriptor.from_tensor(x2, [BM, c.block_k]), TensorDescriptor.from_tensor(weight, [c.block_n, c.block_k]),
            target, M, N, K, k_per_split, *out_strides,
            BM=BM, BN=c.block_n, BK=c.block_k, num_warps=c.num_warps, num_stages=c.num_stages)
    else:
        _skinny_matmul_kernel[grid](
            x2, weight, target, M, N, K, k_per_split, *x2.stride(), *weight.stride(), *out_strides,
            BM=BM, BN=c.block_n, BK=c.block_k, num_warps=c.num_warps, num_stages=c.num_stages)
    if splits > 1:
        BLOCK = 1024
        sum_splits_kernel[(triton.cdiv(M * N, BLOCK),)](target, out, M * N, SPLIT_K=splits, BLOCK=BLOCK)
    return out.view(*lead, N)


MAX_ROWS = 128  # one row tile: every weight byte is read once


def tma_ready(*tensors: torch.Tensor) -> bool:
    """Whether tensor descriptors can address these 2-D operands: contiguous, 16-byte aligned base and rows."""
    return all(t.is_contiguous() and t.data_ptr() % 16 == 0 and t.shape[-1] * t.element_size() % 16 == 0
               for t in tensors)


def block_m(M: int) -> int:
    return min(MAX_ROWS, max(16, triton.next_power_of_2(M)))


SHARED_MEMORY_BUDGET = 200 * 1024  # bytes of pipelined tiles per program (sm_90 has 228 KB)


def tile_config(M: int, N: int, K: int, block_n: int, block_k: int, sms: int, tma: bool) -> SkinnyConfig:
    """The launch of one ``block_n × block_k`` tile shape for an M × N × K product: the split-K that brings the
    program count near two per SM (while each split keeps ≥ 4 K steps) and as many pipeline stages (≤ 4) as fit
    the shared memory."""
    stages = min(4, SHARED_MEMORY_BUDGET // ((block_m(M) + block_n) * block_k * 2))
    tiles = triton.cdiv(N, block_n) * triton.cdiv(M, block_m(M))
    split = 1
    while tiles * split < 2 * sms and K // (split * 2) >= 4 * block_k:
        split *= 2
    return SkinnyConfig(block_n, block_k, split, 4, num_stages=stages, tma=tma)
