"""The routed experts of a sparse MoE block as two grouped GEMMs over expert-sorted row blocks, in Triton.

`expert_blocks` orders the (token, slot) assignments by expert and cuts them into blocks of ``block_m`` rows of
one expert. The gate_up kernel multiplies each block's token rows by its expert's gate and up rows (two fp32
accumulators) and applies the SwiGLU in its epilogue, writing the hidden rows [A, I] in expert order; the down
kernel multiplies them by the expert's down weights and scales each row by its mixing weight, writing it to the
assignment's own row of [A, H] (token-major). The k rows of a token are then summed in a fixed order. Programs of
one column tile run the blocks of an expert side by side, so each active expert's weights are read from memory
once per pass, however many tokens chose it; a decode step (one row per expert) is the same kernels at
``block_m = 16``, the smallest tensor-core tile, with the padding rows masked.

Four launches (blocks, gate_up, down, the sum), no atomics and no host read: static shapes for a given token
count, bit-identical between eager runs and CUDA-graph replays. Numerics follow the twin
(`reference.routed_experts_reference`): fp32 accumulation, gate and up rounded to the activations' dtype, then
silu(gate) and its product with up, the expert output, and its product with the mixing weight, each rounded as
PyTorch rounds them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dflash_tfm.kernels import use_triton
from dflash_tfm.kernels.moe.decode_experts import decode_routed_experts
from dflash_tfm.kernels.moe.expert_blocks import expert_blocks
from dflash_tfm.kernels.moe.reference import routed_experts_reference
from dflash_tfm.tuning import TunedChoice


# One token's routed experts (a decode step): the grouped kernels below, or the two GEMV launches of
# `decode_experts.py`, whichever the first use per shape times faster on this GPU (not yet compared on an H100).
DECODE_EXPERTS = TunedChoice("decode_experts", default="grouped", candidates=("grouped", "gemv"))


@dataclass(frozen=True)
class ExpertTiles:
    """Tile sizes of both GEMMs: ``block_m`` rows of one expert by ``block_n`` output columns, ``block_k`` deep."""
    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


def default_tiles(assignments: int, num_experts: int) -> ExpertTiles:
    """Rows per block near the expected rows per expert (16 … 64), so padding stays under one block per expert;
    at 16 rows (decode, tree verify) narrower column tiles put more programs on the weight stream."""
    block_m = min(64, max(16, triton.next_power_of_2(triton.cdiv(assignments, num_experts))))
    if block_m == 16:
        return ExpertTiles(block_m=16, block_n=32, block_k=128, num_stages=4)
    return ExpertTiles(block_m=block_m, block_n=64, block_k=64, num_stages=3)


@triton.jit
def _block(order, block_expert, block_rows, BM: tl.constexpr):
    """A program's block: its expert (−1: unused), its rows as positions in `order`, their mask and assignments."""
    block = tl.program_id(0)
    expert = tl.load(block_expert + block)
    rows = tl.load(block_rows + 2 * block) + tl.arange(0, BM)
    rm = rows < tl.load(block_rows + 2 * block + 1)
    assignments = tl.load(order + rows, mask=rm, other=0).to(tl.int64)
    return expert, rows, rm, assignments


@triton.jit
def _gate_up_kernel(
    x, w, hidden, order, block_expert, block_rows, H, I, TOP_K, sxt, sxh, swe, swn, swh,
    PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    """Grid (blocks, cdiv(I, BN)). x [T, H]; w [E, 2I, H] (gate rows, then up rows); hidden [A, I] in expert
    order ← silu(x Wgᵀ) · (x Wuᵀ)."""
    expert, rows, rm, assignments = _block(order, block_expert, block_rows, BM)
    if expert < 0:
        return
    tokens = assignments // TOP_K
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = offs_n < I
    w_gate = w + expert.to(tl.int64) * swe + offs_n[None, :] * swn
    w_up = w_gate + I * swn
    acc_gate = tl.zeros([BM, BN], dtype=tl.float32)
    acc_up = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, H, BK):
        offs_k = k0 + tl.arange(0, BK)
        km = offs_k < H
        a = tl.load(x + tokens[:, None] * sxt + offs_k[None, :] * sxh, mask=rm[:, None] & km[None, :], other=0.0)
        wm = km[:, None] & nm[None, :]
        acc_gate = tl.dot(a, tl.load(w_gate + offs_k[:, None] * swh, mask=wm, other=0.0), acc_gate,
                          input_precision=PRECISION)
        acc_up = tl.dot(a, tl.load(w_up + offs_k[:, None] * swh, mask=wm, other=0.0), acc_up,
                        input_precision=PRECISION)
    dtype = hidden.dtype.element_ty
    gate = acc_gate.to(dtype).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
    h = (act * acc_up.to(dtype).to(tl.float32)).to(dtype)
    tl.store(hidden + rows[:, None] * I + offs_n[None, :], h, mask=rm[:, None] & nm[None, :])


@triton.jit
def _down_kernel(
    hidden, w, mixing, out, order, block_expert, block_rows, H, I, swe, swh, swi,
    PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    """Grid (blocks, cdiv(H, BN)). hidden [A, I] in expert order; w [E, H, I]; mixing [A] and out [A, H]
    token-major: out[a] ← mixing[a] · (hidden row of a) Wdᵀ."""
    expert, rows, rm, assignments = _block(order, block_expert, block_rows, BM)
    if expert < 0:
        return
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = offs_n < H
    w_e = w + expert.to(tl.int64) * swe + offs_n[None, :] * swh
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, I, BK):
        offs_k = k0 + tl.arange(0, BK)
        km = offs_k < I
        a = tl.load(hidden + rows[:, None] * I + offs_k[None, :], mask=rm[:, None] & km[None, :], other=0.0)
        acc = tl.dot(a, tl.load(w_e + offs_k[:, None] * swi, mask=km[:, None] & nm[None, :], other=0.0), acc,
                     input_precision=PRECISION)
    dtype = out.dtype.element_ty
    scale = tl.load(mixing + assignments, mask=rm, other=0.0).to(tl.float32)
    y = (acc.to(dtype).to(tl.float32) * scale[:, None]).to(dtype)
    tl.store(out + assignments[:, None] * H + offs_n[None, :], y, mask=rm[:, None] & nm[None, :])


def routed_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, tiles: ExpertTiles | None = None, elsewhere: bool = False) -> torch.Tensor:
    """x [T, H], mixing weights [T, k] (x's dtype), expert ids [T, k], gate_up [E, 2I, H] (gate rows, then up
    rows), down [E, H, I] -> Σ_j weights[t, j] · SwiGLU_{experts[t, j]}(x[t]) [T, H]. Tiles: `default_tiles`
    unless given. One token without tiles may instead take the two GEMV launches of `decode_experts.py`: a tuned
    choice (`DECODE_EXPERTS`), timed against these kernels on first use per shape. `elsewhere`: ids may be −1,
    an expert another expert-parallel rank holds, whose assignments add nothing here: they are grouped as one
    more expert whose blocks no GEMM program runs (three more small launches, so only expert-parallel layers ask
    for it). Without Triton: `routed_experts_reference`."""
    if not use_triton(x):
        return routed_experts_reference(x, weights, experts, gate_up, down)
    T, k = experts.shape
    E, two_i, H = gate_up.shape
    I = two_i // 2
    if x.shape != (T, H) or weights.shape != (T, k) or down.shape != (E, H, I):
        raise ValueError(f"routed_experts: x {tuple(x.shape)}, weights {tuple(weights.shape)}, experts {(T, k)}, "
                         f"gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)} do not fit together")
    if T == 1 and tiles is None:  # a decode step: the grouped kernels, or two GEMV launches, as timed
        def candidates() -> dict:
            return {"grouped": lambda: _grouped(x, weights, experts, gate_up, down, None, elsewhere),
                    "gemv": lambda: decode_routed_experts(x, weights, experts, gate_up, down)}

        key = (H, I, E, k, x.dtype, gate_up.dtype, elsewhere)
        if DECODE_EXPERTS.pick(key, candidates, x.device) == "gemv":
            return decode_routed_experts(x, weights, experts, gate_up, down)
    return _grouped(x, weights, experts, gate_up, down, tiles, elsewhere)


def _grouped(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
             down: torch.Tensor, tiles: ExpertTiles | None, elsewhere: bool) -> torch.Tensor:
    """`routed_experts` by the grouped kernels (the module docstring)."""
    T, k = experts.shape
    E, two_i, H = gate_up.shape
    I = two_i // 2
    A = T * k
    t = tiles or default_tiles(A, E)
    if elsewhere:  # the others' assignments as expert E, whose blocks are then marked unused (−1)
        blocks = expert_blocks(torch.where(experts < 0, E, experts), E + 1, t.block_m)
        blocks = blocks._replace(block_expert=torch.where(blocks.block_expert == E, -1, blocks.block_expert))
    else:
        blocks = expert_blocks(experts, E, t.block_m)
    nb = blocks.block_expert.shape[0]
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    launch = dict(PRECISION=precision, BM=t.block_m, BN=t.block_n, BK=t.block_k, num_warps=t.num_warps,
                  num_stages=t.num_stages)
    hidden = torch.empty(A, I, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(nb, triton.cdiv(I, t.block_n))](
        x, gate_up, hidden, blocks.order, blocks.block_expert, blocks.block_rows, H, I, k, *x.stride(),
        *gate_up.stride(), **launch)
    out = (torch.zeros if elsewhere else torch.empty)(A, H, dtype=x.dtype, device=x.device)  # unrun rows add 0
    _down_kernel[(nb, triton.cdiv(H, t.block_n))](
        hidden, down, weights.contiguous(), out, blocks.order, blocks.block_expert, blocks.block_rows, H, I,
        *down.stride(), **launch)
    return out.view(T, k, H).sum(dim=1)
