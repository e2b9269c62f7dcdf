"""``y = x Wᵀ`` for few rows (2 … 256: tree verify, drafter blocks) and large weights, in Triton.

At these sizes a projection is a weight stream: each weight byte is used M times, far below what the tensor
cores could do with it, so the kernel's only job is to keep enough weight bytes in flight. One program owns a
``BM × BN`` output tile and a slice of K (split-K when N alone gives too few programs to fill the GPU); the
split partials go to an fp32 workspace ``[SPLIT_K, M, N]`` and a second kernel sums them in a fixed order, so
results are deterministic (no atomics) and identical between eager runs and CUDA-graph replays. A configuration
with ``tma`` loads both tiles through host-made tensor descriptors (Hopper's TMA engine: no address arithmetic
or masks in the loop, out-of-bounds reads are zeros), when the operands are contiguous and 16-byte aligned.
A ``swap`` configuration (TMA only) computes ``yᵀ = W xᵀ``: the weight rows fill the MMA's long side (64-row
granularity on Hopper) and the few token rows its short side, as one tile of up to 64 rows plus, past 64 rows,
a tail tile of 16 … 64; at 65 rows that is 80 padded rows of MMA work instead of the 128 of ``x Wᵀ``.
The twin is ``F.linear``. Which of the two runs for a shape is decided by timing (``layers/linear.py``).
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
    swap: bool = False  # yᵀ = W xᵀ through tensor descriptors (needs tma=True)


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
def _skinny_matmul_swap_kernel(
    x_desc, x_tail_desc, w_desc, out, M, N, K, k_per_split, som, son, sos,
    BN: tl.constexpr, BK: tl.constexpr, BX: tl.constexpr, BX_TAIL: tl.constexpr,
):
    """Grid (cdiv(N, BN), 1, SPLIT_K). ``yᵀ = W xᵀ`` tile by tile: rows [0, BX) of x in one MMA operand and,
    when BX_TAIL > 0, rows [BX, BX + BX_TAIL) in a second one that shares the weight tile."""
    n0 = tl.program_id(0) * BN
    split = tl.program_id(2)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros([BN, BX], dtype=tl.float32)
    acc_tail = tl.zeros([BN, max(BX_TAIL, 16)], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        w_t = w_desc.load([n0, k0])
        acc += tl.dot(w_t, x_desc.load([0, k0]).T)
        if BX_TAIL > 0:
            acc_tail += tl.dot(w_t, x_tail_desc.load([BX, k0]).T)
    offs_n = n0 + tl.arange(0, BN)
    base = out + split * sos + offs_n[:, None] * son
    offs_m = tl.arange(0, BX)
    tl.store(base + offs_m[None, :] * som, acc.to(out.dtype.element_ty),
             mask=(offs_n < N)[:, None] & (offs_m < M)[None, :])
    if BX_TAIL > 0:
        offs_t = BX + tl.arange(0, max(BX_TAIL, 16))
        tl.store(base + offs_t[None, :] * som, acc_tail.to(out.dtype.element_ty),
                 mask=(offs_n < N)[:, None] & (offs_t < M)[None, :])


@triton.jit
def _sum_splits_kernel(part, out, MN, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
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
    if c.swap and c.tma and tma_ready(x2, weight):
        BX, BX_TAIL = swap_blocks(M)
        tail = TensorDescriptor.from_tensor(x2, [max(BX_TAIL, 16), c.block_k])
        _skinny_matmul_swap_kernel[(grid[0], 1, splits)](
            TensorDescriptor.from_tensor(x2, [BX, c.block_k]), tail,
            TensorDescriptor.from_tensor(weight, [c.block_n, c.block_k]), target, M, N, K, k_per_split, *out_strides,
            BN=c.block_n, BK=c.block_k, BX=BX, BX_TAIL=BX_TAIL, num_warps=c.num_warps, num_stages=c.num_stages)
    elif c.tma and tma_ready(x2, weight):
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
        _sum_splits_kernel[(triton.cdiv(M * N, BLOCK),)](target, out, M * N, SPLIT_K=splits, BLOCK=BLOCK)
    return out.view(*lead, N)


MAX_ROWS = 128  # one row tile: every weight byte is read once


def tma_ready(*tensors: torch.Tensor) -> bool:
    """Whether tensor descriptors can address these 2-D operands: contiguous, 16-byte aligned base and rows."""
    return all(t.is_contiguous() and t.data_ptr() % 16 == 0 and t.shape[-1] * t.element_size() % 16 == 0
               for t in tensors)


def block_m(M: int) -> int:
    return min(MAX_ROWS, max(16, triton.next_power_of_2(M)))


SWAP_HEAD = 64  # rows of a swap configuration's first x tile once M > 64


def swap_blocks(M: int) -> tuple[int, int]:
    """(rows of the first x tile, rows of the tail tile or 0) of a swap configuration: powers of two ≥ 16 that
    cover M with at most SWAP_HEAD + 64 rows (65 rows: 64 + 16)."""
    if M <= SWAP_HEAD:
        return max(16, triton.next_power_of_2(M)), 0
    return SWAP_HEAD, max(16, triton.next_power_of_2(M - SWAP_HEAD))


SHARED_MEMORY_BUDGET = 200 * 1024  # bytes of pipelined tiles per program (sm_90 has 228 KB)


def candidate_configs(M: int, N: int, K: int, sms: int) -> list[SkinnyConfig]:
    """The configurations worth timing for one shape: tile widths and K depths that keep many weight bytes in
    flight, with the split-K that brings the program count near two per SM, 8 warps for tall tiles, and as many
    pipeline stages (≤ 4) as fit the shared memory; each tile shape also with TMA loads and, from 2 rows on,
    swapped (``yᵀ = W xᵀ``)."""
    configs = []
    for block_n in (64, 128):
        for block_k in (128, 256):
            for swap in (False, True) if M > 1 else (False,):
                x_rows = sum(swap_blocks(M)) if swap else block_m(M)
                stages = min(4, SHARED_MEMORY_BUDGET // ((x_rows + block_n) * block_k * 2))
                if stages < 2:
                    continue
                tiles = triton.cdiv(N, block_n) * (1 if swap else triton.cdiv(M, block_m(M)))
                split = 1
                while tiles * split < 2 * sms and K // (split * 2) >= 4 * block_k:
                    split *= 2
                if swap:
                    for warps in ((4, 8) if block_n >= 128 else (4,)):
                        configs.append(SkinnyConfig(block_n, block_k, split, warps, stages, tma=True, swap=True))
                    continue
                for warps in ((4, 8) if block_m(M) >= 64 else (4,)):
                    configs.append(SkinnyConfig(block_n, block_k, split, warps, num_stages=stages))
                configs.append(SkinnyConfig(block_n, block_k, split, 4, num_stages=stages, tma=True))
    return configs
