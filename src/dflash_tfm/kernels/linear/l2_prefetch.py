"""Warm the L2 cache with part of a weight while the GPU is busy with latency-bound work.

Between two projections of a verify step (e.g. the GDN tree solve, ~30 µs per layer) HBM sits almost idle;
the next GEMM then streams its whole weight. Asking the copy engine to bring part of that weight into L2
beforehand (``cp.async.bulk.prefetch.L2``, sm_90: no registers, no result, nothing waits for it) lets the GEMM
read those bytes from L2. The prefetch is only a hint: its twin is to do nothing.

Which part helps depends on the order in which the GEMM's programs read the weight, hence three layouts:
"prefix" (the first bytes: the first output rows, read first when the GEMM runs in several waves), "rows" (the
same share at the start of every row: the first K steps of every program of a one-wave GEMM without split-K)
and "strided" (small chunks spread evenly over the whole weight: about the same share of every program's
bytes, whatever its tile and split-K).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK_BYTES = 4096  # bytes per bulk prefetch instruction (a multiple of 16)
STRIDED_CHUNK_BYTES = 1024  # the "strided" layout's pieces: 8 K steps of 64 bf16 columns of one row
BLOCK = 128  # prefetch instructions per program (one per thread at 4 warps)
LAYOUTS = ("prefix", "rows", "strided")


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


def prefetch_pieces(shape: tuple[int, int], element_size: int, nbytes: int, layout: str) -> tuple[int, int, int]:
    """(pieces, stride, piece_bytes): the kernel asks for ``piece_bytes`` at byte offsets ``0, stride, …`` of a
    contiguous ``shape`` tensor, about ``nbytes`` (> 0) in all, in ``layout``; every piece lies inside the
    tensor, and offsets and sizes are multiples of 16 bytes (the instruction's alignment). (0, 0, 0) for a
    tensor of less than 16 bytes."""
    total = shape[0] * shape[1] * element_size
    if layout == "rows":
        row = shape[1] * element_size
        if row % 16:
            raise ValueError("l2_prefetch(layout='rows') needs rows of a multiple of 16 bytes")
        return shape[0], row, min(row, -(-nbytes // shape[0] // 16) * 16)
    if layout == "strided" and total >= STRIDED_CHUNK_BYTES:  # evenly spaced pieces
        pieces = max(1, min(nbytes, total) // STRIDED_CHUNK_BYTES)
        return pieces, total // pieces // 16 * 16, STRIDED_CHUNK_BYTES
    prefix = min(-(-nbytes // 16) * 16, total // 16 * 16)
    return (1, total, prefix) if prefix else (0, 0, 0)


def l2_prefetch(weight: torch.Tensor, nbytes: int, layout: str = "prefix") -> None:
    """Ask for about ``nbytes`` of the contiguous 2-D ``weight`` in L2, laid out as ``layout`` (`LAYOUTS`, see
    the module docstring). A no-op off CUDA and for ``nbytes`` ≤ 0."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not weight.is_cuda or nbytes <= 0:
        return
    if weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(f"l2_prefetch needs a contiguous 2-D tensor, got shape {tuple(weight.shape)}")
    pieces, stride, piece_bytes = prefetch_pieces(tuple(weight.shape), weight.element_size(), nbytes, layout)
    if not pieces:
        return
    count = pieces * triton.cdiv(piece_bytes, CHUNK_BYTES)
    _l2_prefetch_kernel[(triton.cdiv(count, BLOCK),)](weight, pieces, stride, piece_bytes, CHUNK=CHUNK_BYTES,
                                                        BLOCK=BLOCK, num_warps=4)
