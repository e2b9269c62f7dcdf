"""The twin of `weight_stream.fp8_matmul`: dequantise the FP8 weight with its per-row block scales, then
``F.linear`` in the activations' dtype. This is what an FP8 projection means, what runs on the CPU, and what
prefill runs on a GPU (many rows: the dequantised copy is read by one cuBLAS GEMM)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash_tfm.kernels.fp8.block_quant import dequantize_rows


def fp8_matmul_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ (weight · scale)ᵀ -> [..., N]``: weight FP8 [N, K], scale fp32 [N, ⌈K/128⌉]."""
    return F.linear(x, dequantize_rows(weight, scale, x.dtype))
