"""The row blocks of a grouped expert GEMM: the (token, slot) assignments ordered by expert and cut into blocks of
at most ``block_m`` rows of one expert, on the device and in one launch.

A grouped GEMM program multiplies one block by its expert's weights, so every expert's rows must be contiguous
and each block must know its expert and rows. Experts get ``ceil(count / block_m)`` blocks each; their total is
data-dependent, but never more than `max_blocks` (each active expert wastes under one block, and every block holds
at least one row), so the GEMM's grid is static for a given token count and blocks past the real count (expert
−1) do nothing. No count comes back to the host, which is what lets a CUDA graph capture the MoE block.

One kernel does it all without atomics, so the order is deterministic (stable: an expert's rows keep token
order). Program c owns assignments and blocks ``[c · chunk, (c + 1) · chunk)``. It counts every expert's
assignments, in total and before its chunk, with histograms over all ids (cheap next to the GEMMs even for a
2048-token prefill chunk: 16 histograms of 1024 ids), derives each expert's first row and first block by prefix
sums, writes its blocks' table and places its own assignments: position = the expert's next free row (a gather
from the running counts) + the number of earlier same-expert assignments in its sub-chunk. A decode step is one
program. Twin: `expert_blocks_reference`.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dflash_tfm.kernels import use_triton

CHUNK = 256  # assignments (and blocks) per program
HIST = 1024  # ids per histogram of the counting pass


class ExpertBlocks(NamedTuple):
    """order [A] int32: assignment indices (t · k + j) grouped by expert, ascending expert, stable.
    block_expert [max_blocks] int32: each block's expert, −1 for the unused blocks past the last.
    block_rows [max_blocks, 2] int32: each block's rows ``[first, end)`` as positions in `order` (0, 0 unused)."""
    order: torch.Tensor
    block_expert: torch.Tensor
    block_rows: torch.Tensor


def max_blocks(assignments: int, num_experts: int, block_m: int) -> int:
    """The most blocks `assignments` rows over `num_experts` experts can need: Σ ceil(count_e / block_m) over the
    at most min(E, A) active experts is ≤ (A + active · (block_m − 1)) / block_m, and no block is empty."""
    active = min(num_experts, assignments)
    return min(assignments, (assignments + active * (block_m - 1)) // block_m)


@triton.jit
def _expert_blocks_kernel(
    ids, order, block_expert, block_rows, A, E, NUM_BLOCKS,
    BM: tl.constexpr, BE: tl.constexpr, CHUNK: tl.constexpr, HIST: tl.constexpr, BA: tl.constexpr,
):
    """Grid (cdiv(A, CHUNK),). ids [A] expert of each assignment (token-major); BE ≥ E a power of two; BA
    divides CHUNK."""
    start = tl.program_id(0) * CHUNK
    total = tl.zeros([BE], dtype=tl.int32)
    before = tl.zeros([BE], dtype=tl.int32)
    for a0 in range(0, A, HIST):
        offs = a0 + tl.arange(0, HIST)
        e = tl.load(ids + offs, mask=offs < A, other=0).to(tl.int32)
        total += tl.histogram(e, BE, mask=offs < A)
        before += tl.histogram(e, BE, mask=offs < tl.minimum(A, start))
    first_row = tl.cumsum(total, axis=0) - total
    blocks = (total + BM - 1) // BM
    block_end = tl.cumsum(blocks, axis=0)

    for b0 in range(start, tl.minimum(start + CHUNK, NUM_BLOCKS), BA):
        b = b0 + tl.arange(0, BA)
        # a block's expert: how many experts' blocks end at or before it (E or more: past the last block)
        expert = tl.sum((block_end[None, :] <= b[:, None]).to(tl.int32), axis=1)
        used = expert < E
        e = tl.minimum(expert, BE - 1)
        row0 = tl.gather(first_row, e, 0) + (b - tl.gather(block_end - blocks, e, 0)) * BM
        row1 = tl.minimum(row0 + BM, tl.gather(first_row + total, e, 0))
        bm = b < NUM_BLOCKS
        tl.store(block_expert + b, tl.where(used, expert, -1), mask=bm)
        tl.store(block_rows + 2 * b, tl.where(used, row0, 0), mask=bm)
        tl.store(block_rows + 2 * b + 1, tl.where(used, row1, 0), mask=bm)

    lanes = tl.arange(0, BA)
    next_row = first_row + before
    for a0 in range(start, tl.minimum(start + CHUNK, A), BA):
        offs = a0 + lanes
        am = offs < A
        e = tl.load(ids + offs, mask=am, other=0).to(tl.int32)
        earlier = (e[:, None] == e[None, :]) & (lanes[None, :] < lanes[:, None])
        position = tl.gather(next_row, e, 0) + tl.sum(earlier.to(tl.int32), axis=1)
        tl.store(order + position, offs, mask=am)
        next_row += tl.histogram(e, BE, mask=am)


def expert_blocks(experts: torch.Tensor, num_experts: int, block_m: int, chunk: int = CHUNK) -> ExpertBlocks:
    """Expert ids [T, k] -> the `ExpertBlocks` of their assignments for blocks of ``block_m`` rows (``chunk``, a
    power of two ≥ 16: assignments per program). Without Triton: `expert_blocks_reference`."""
    if not use_triton(experts):
        return expert_blocks_reference(experts, num_experts, block_m)
    ids = experts.reshape(-1)
    A = ids.shape[0]
    nb = max_blocks(A, num_experts, block_m)
    order = torch.empty(A, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(nb, dtype=torch.int32, device=ids.device)
    block_rows = torch.empty(nb, 2, dtype=torch.int32, device=ids.device)
    _expert_blocks_kernel[(triton.cdiv(A, chunk),)](
        ids, order, block_expert, block_rows, A, num_experts, nb,
        BM=block_m, BE=max(16, triton.next_power_of_2(num_experts)), CHUNK=chunk, HIST=max(chunk, HIST),
        BA=min(chunk, 32), num_warps=4)
    return ExpertBlocks(order, block_expert, block_rows)


def expert_blocks_reference(experts: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """`expert_blocks` by a stable sort and per-expert counts."""
    ids = experts.reshape(-1)
    A = ids.shape[0]
    order = ids.argsort(stable=True)
    counts = torch.bincount(ids, minlength=num_experts)
    first_row = counts.cumsum(0) - counts
    blocks = (counts + block_m - 1) // block_m
    block_end = blocks.cumsum(0)
    b = torch.arange(max_blocks(A, num_experts, block_m), device=ids.device)
    expert = torch.searchsorted(block_end, b, right=True)
    used = expert < num_experts
    e = expert.clamp(max=num_experts - 1)
    row0 = first_row[e] + (b - (block_end - blocks)[e]) * block_m
    row1 = torch.minimum(row0 + block_m, first_row[e] + counts[e])
    rows = torch.stack([row0, row1], dim=-1) * used.unsqueeze(-1)
    return ExpertBlocks(order.int(), torch.where(used, expert, -1).int(), rows.int())
