"""Rotary position embedding, rotate-half style, optionally on only the first `rotary_dim` dims, with any RoPE
scaling `rope_parameters.RopeParameters` describes (its attention factor folded into the tables)."""
from __future__ import annotations

import torch
from torch import nn

from dflash_tfm.rope_parameters import RopeParameters


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position (a device tensor, so CUDA graphs can replay).

    Partial rotary (Qwen3.5: 64 of 256 dims) rotates the leading `rotary_dim` dims and passes the rest. The
    tables are transformers' cos/sin: angles `position · inv_freq` in fp32, then cos and sin times the scaling's
    attention factor (YaRN's mscale; 1 for the other types), so every consumer of the tables gets it for free.
    """

    def __init__(self, head_dim: int, rotary_dim: int, rope: RopeParameters, max_positions: int,
                 what: str = "model") -> None:
        super().__init__()
        if rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(f"rotary_dim {rotary_dim} must be even and <= head_dim {head_dim}")
        rope.check_table_length(max_positions, what)
        self.rotary_dim = rotary_dim
        inv_freq, attention_factor = rope.inverse_frequencies(rotary_dim)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_table", emb.cos() * attention_factor, persistent=False)
        self.register_buffer("sin_table", emb.sin() * attention_factor, persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, T, H, D], k [B, T, Hkv, D], positions [B, T] long -> rotated (q, k)."""
        return apply_rotary(q, k, self.cos_table, self.sin_table, positions, self.rotary_dim)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor,
    rotary_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-tensor form (fusable): tables [max_pos, rotary_dim] fp32, gathered at `positions`."""
    cos, sin = _angles(cos_table, sin_table, positions, q.dtype)
    return _rotate(q, cos, sin, rotary_dim), _rotate(k, cos, sin, rotary_dim)


def apply_rotary_to_keys(
    k: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor, rotary_dim: int,
) -> torch.Tensor:
    """:func:`apply_rotary` of keys alone (k [B, T, Hkv, D]; cached context keys have no queries)."""
    return _rotate(k, *_angles(cos_table, sin_table, positions, k.dtype), rotary_dim)


def _angles(cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin at `positions` [B, T] as [B, T, 1, rotary_dim] in `dtype` (broadcast over heads)."""
    return cos_table[positions].unsqueeze(2).to(dtype), sin_table[positions].unsqueeze(2).to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    rot, passthrough = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated_half = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    out = rot * cos + rotated_half * sin
    return torch.cat((out, passthrough), dim=-1) if passthrough.shape[-1] else out
