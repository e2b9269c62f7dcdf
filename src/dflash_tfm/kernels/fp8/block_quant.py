"""The FP8 block format of Qwen's (and DeepSeek's) FP8 checkpoints, and how the engine holds it in memory.

On disk a quantized projection ``X.weight`` is ``float8_e4m3fn [N, K]`` beside ``X.weight_scale_inv`` fp32
``[⌈N/128⌉, ⌈K/128⌉]``; the real weight is ``weight · scale_inv[n // 128, k // 128]`` (despite the name, the
stored value multiplies). In memory the engine keeps the FP8 bytes as they are and expands the scales to one row
per output row, ``[N, ⌈K/128⌉]`` (`expand_block_scales`). Why per row: the loader concatenates projections along
the output dim (q | k | v, gate | up, the GDN input projections) and Qwen3-Next's are even regrouped per head, so
a part can start in the middle of a 128-row block; per-row scales split, regroup and concatenate exactly like the
weight rows, at 4 bytes per 128 weight bytes (3 % more to read than the 128 × 128 grid).

Quantising (`quantize_blocks`, for ``--quantization fp8``) follows the checkpoints' recipe: per 128 × 128 block,
scale = amax / 448 (the largest e4m3 value), weight / scale rounded to e4m3; an all-zero block gets scale 1.
"""
from __future__ import annotations

import torch

BLOCK = 128
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The stored ``weight_scale_inv`` shape of a weight: its last two dims in 128-blocks (leading dims kept)."""
    *lead, n, k = shape
    return (*lead, -(-n // BLOCK), -(-k // BLOCK))


def expand_block_scales(scale_inv: torch.Tensor, rows: int) -> torch.Tensor:
    """Stored block scales ``[..., ⌈N/128⌉, KB]`` -> per-row scales ``[..., N, KB]`` fp32 (row n takes its block's)."""
    return scale_inv.float().repeat_interleave(BLOCK, dim=-2)[..., :rows, :].contiguous()


def quantize_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A 16/32-bit weight ``[..., N, K]`` -> (FP8 weight, stored block scales ``[..., ⌈N/128⌉, ⌈K/128⌉]`` fp32), the
    checkpoints' format: each 128 × 128 block scaled so its largest magnitude becomes 448."""
    *lead, n, k = weight.shape
    nb, kb = -(-n // BLOCK), -(-k // BLOCK)
    padded = torch.zeros(*lead, nb * BLOCK, kb * BLOCK, dtype=torch.float32, device=weight.device)
    padded[..., :n, :k] = weight.float()
    blocks = padded.view(*lead, nb, BLOCK, kb, BLOCK)
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., nb, kb]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(*lead, nb * BLOCK, kb * BLOCK)[..., :n, :k].contiguous(), scale


def dequantize_rows(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 ``[..., N, K]`` times per-row scales ``[..., N, ⌈K/128⌉]`` -> ``dtype`` (the product in fp32, rounded
    once)."""
    k = weight.shape[-1]
    per_column = scale.repeat_interleave(BLOCK, dim=-1)[..., :k]
    return (weight.float() * per_column).to(dtype)
