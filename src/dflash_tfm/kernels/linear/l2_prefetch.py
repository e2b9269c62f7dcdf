"""Warm the L2 cache with the start of a weight while the GPU is busy with latency-bound work.

Between two projections of a verify step (e.g. the GDN tree solve, ~30 µs per layer) HBM sits almost idle;
the next GEMM then streams its whole weight. Asking the copy engine to bring the first bytes of that weight
into L2 beforehand (``cp.async.bulk.prefetch.L2``, sm_90: no registers, no result, nothing waits for it)
lets the GEMM read them from L2. The prefetch is only a hint: its twin is to do nothing.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK_BYTES = 4096  # bytes per bulk prefetch instruction (a multiple of 16)
BLOCK = 128  # prefetch instructions per program (one per thread at 4 warps)


@triton.jit
def _l2_prefetch_kernel(ptr, rows, row_stride, row_bytes, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (cdiv(rows · cdiv(row_bytes, CHUNK), BLOCK),): the first row_bytes bytes of each of `rows` rows,
    row_stride bytes apart, one bulk prefetch of ≤ CHUNK bytes per element."""
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    per_row = tl.cdiv(row_bytes, CHUNK)
    r = idx // per_row
    c = idx % per_row
    nbytes = tl.minimum(row_bytes - c * CHUNK, CHUNK)
    addr = ptr.to(tl.pointer_type(tl.int8)) + r.to(tl.int64) * row_stride + c.to(tl.int64) * CHUNK
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r,r", [addr, nbytes, (r < rows).to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


def l2_prefetch(weight: torch.Tensor, nbytes: int, spread_rows: bool = False) -> None:
    """Ask for about ``nbytes`` of the contiguous 2-D ``weight`` in L2: its first bytes, or with
    ``spread_rows`` the same share of every row (for GEMMs whose programs each stream a few rows from the
    start of K). A no-op off CUDA and for ``nbytes`` ≤ 0."""
    if not weight.is_cuda or nbytes <= 0:
        return
    if weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(f"l2_prefetch needs a contiguous 2-D tensor, got shape {tuple(weight.shape)}")
    total = weight.numel() * weight.element_size()
    nbytes = min(nbytes, total)
    if spread_rows:
        if (weight.shape[1] * weight.element_size()) % 16:
            raise ValueError("l2_prefetch(spread_rows=True) needs rows of a multiple of 16 bytes")
        rows, stride = weight.shape[0], weight.shape[1] * weight.element_size()
        row_bytes = min(stride, -(-nbytes // rows // 16) * 16)
    else:
        rows, stride, row_bytes = 1, total, -(-nbytes // 16) * 16
    count = rows * triton.cdiv(row_bytes, CHUNK_BYTES)
    _l2_prefetch_kernel[(triton.cdiv(count, BLOCK),)](weight, rows, stride, row_bytes, CHUNK=CHUNK_BYTES,
                                                        BLOCK=BLOCK, num_warps=4)
