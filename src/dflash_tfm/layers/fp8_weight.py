"""A projection weight held in FP8 with per-row block scales, and the product with it.

`Fp8Weight` takes the place of a projection's BF16 parameter (the loader swaps it in, `loading/fp8_layout.py`),
so the layers keep calling `linear(x, self.o_proj)` and `layers/linear.py` dispatches here. It holds
`weight` float8_e4m3fn [..., N, K] and `scale` fp32 [..., N, ⌈K/128⌉] (`kernels/fp8/block_quant.py` says why
per row), as buffers, so they move with the module and are no one's parameters to train.

A fused projection can mix parts stored in FP8 with parts the checkpoint keeps in BF16 (Qwen's FP8 releases keep
the GDN `in_proj_a` / `in_proj_b` and the MoE router and shared-expert gate in BF16, for their precision). Those
rows must stay exact, so one contiguous range of rows, `dense_rows`, is held in `dense` (the activations' dtype)
and overwrites the FP8 product's columns there; its FP8 rows are zero with scale 0.

How the product runs: up to `MAX_ROWS` rows on CUDA (decode, tree verify, drafter-sized blocks) the Triton weight
stream reads the FP8 bytes once and scales in the kernel; more rows (prefill) dequantise the weight to the
activations' dtype and run cuBLAS, where the weight is reused by many rows and a transient BF16 copy is cheap
next to the GEMM; on the CPU the twin (the same dequantise-then-matmul) runs. Which launch of the weight stream
(tile width, split-K, the one-row GEMV: `kernels/fp8/weight_stream.LAUNCHES`) runs for a shape is a tuned
choice, `FP8_PROJECTION`: the fastest one differs between the 5120-wide and the 35k-wide projections and between
one row and 65 (the H100 sweep in docs/PERFORMANCE.md), so it is timed once per GPU model like the BF16
projections' kernels (`dflash_tfm.tuning`).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from dflash_tfm.kernels import use_triton
from dflash_tfm.kernels.fp8.block_quant import BLOCK, FP8_DTYPE, dequantize_rows
from dflash_tfm.kernels.fp8.weight_stream import (DEFAULT_LAUNCH, LAUNCHES, MAX_ROWS, fp8_matmul, launches_for,
                                                  multiprocessors, stream_config)
from dflash_tfm.tuning import TunedChoice

FP8_PROJECTION = TunedChoice("fp8_projection", default=DEFAULT_LAUNCH, candidates=tuple(LAUNCHES))


class Fp8Weight(nn.Module):
    """An FP8 projection weight [..., N, K] with per-row block scales and an optional exact row range."""

    def __init__(self, shape: tuple[int, ...], dense_rows: tuple[int, int] | None = None,
                 dense_dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None) -> None:
        super().__init__()
        *lead, n, k = shape
        self.register_buffer("weight", torch.zeros(shape, dtype=FP8_DTYPE, device=device))
        self.register_buffer("scale", torch.zeros(*lead, n, -(-k // BLOCK), dtype=torch.float32, device=device))
        self.dense_rows = dense_rows
        dense = None if dense_rows is None else torch.empty(dense_rows[1] - dense_rows[0], k, dtype=dense_dtype,
                                                            device=device)
        self.register_buffer("dense", dense)

    @classmethod
    def of(cls, weight: torch.Tensor, scale: torch.Tensor) -> "Fp8Weight":
        """A holder around existing tensors (no copy), e.g. one expert of a stack."""
        holder = cls.__new__(cls)
        nn.Module.__init__(holder)
        holder.register_buffer("weight", weight)
        holder.register_buffer("scale", scale)
        holder.dense_rows = None
        holder.register_buffer("dense", None)
        return holder

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def __getitem__(self, index) -> "Fp8Weight":
        """Experts of a stacked [E, N, K] weight (an int or a tensor of ids), as a holder of their own."""
        if self.dense is not None:
            raise TypeError("only stacked expert weights are indexed, and they have no dense rows")
        return Fp8Weight.of(self.weight[index], self.scale[index])

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight it stands for, in `dtype` (the definition every product with it follows)."""
        w = dequantize_rows(self.weight, self.scale, dtype)
        if self.dense is not None:
            w[..., self.dense_rows[0]:self.dense_rows[1], :] = self.dense.to(dtype)
        return w

    def write_rows(self, row: int, weight: torch.Tensor, scale: torch.Tensor | None) -> None:
        """Fill rows ``row …`` (counted over all but the last dim): FP8 rows with their per-row scales, or rows of
        the dense range when `scale` is None."""
        if scale is None:
            lo, hi = self.dense_rows or (0, 0)
            if not (lo <= row and row + weight.shape[0] <= hi):
                raise ValueError(f"rows {row}…{row + weight.shape[0]} are not this weight's exact rows {lo}…{hi}")
            self.dense[row - lo : row - lo + weight.shape[0]].copy_(weight)
            return
        self.weight.view(-1, self.weight.shape[-1])[row : row + weight.shape[0]].copy_(weight)
        self.scale.view(-1, self.scale.shape[-1])[row : row + weight.shape[0]].copy_(scale)

    def extra_repr(self) -> str:
        return f"shape={list(self.weight.shape)}, dense_rows={self.dense_rows}"


def fp8_linear(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """``x [..., K] @ weight.dequantize()ᵀ -> [..., N]`` (see the module docstring for which kernel runs)."""
    rows = x.numel() // x.shape[-1]
    if use_triton(x) and rows <= MAX_ROWS:
        w, scale = weight.weight, weight.scale
        N, K = w.shape
        config = functools.partial(stream_config, rows, N, K, multiprocessors(x.device))
        name = FP8_PROJECTION.pick(
            (rows, N, K, x.dtype),
            lambda: {n: functools.partial(fp8_matmul, x, w, scale, config(LAUNCHES[n])) for n in launches_for(rows)},
            x.device)
        if name not in launches_for(rows):  # a forced or hand-edited one-row launch: the default takes the rows
            name = DEFAULT_LAUNCH
        y = fp8_matmul(x, w, scale, config(LAUNCHES[name]))
    else:
        y = F.linear(x, dequantize_rows(weight.weight, weight.scale, x.dtype))
    if weight.dense is not None:
        lo, hi = weight.dense_rows
        y[..., lo:hi] = F.linear(x, weight.dense)
    return y
