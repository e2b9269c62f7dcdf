"""Static per-request caches of the target: attention K/V up to the max length, GDN state and conv window.

Allocated once per engine (batch 1 today, the leading dim is the batch) and reused across requests, so
the CUDA graphs that read them never see a new address.
"""
from __future__ import annotations

import torch

from dflash_tfm.config import FULL_ATTENTION, ModelConfig


class ModelCache:
    """attention[i] = (k [B, S, Hkv, D], v [B, S, Hkv, D]); gdn[i] = (state [B, HV, dk, dv] fp32, window [B, C, K-1])."""

    def __init__(self, cfg: ModelConfig, max_len: int, batch: int, dtype: torch.dtype, device: torch.device) -> None:
        self.max_len = max_len
        self.attention: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.gdn: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, t in enumerate(cfg.layer_types):
            if t == FULL_ATTENTION:
                shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
                self.attention[i] = (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            else:
                state = torch.zeros(batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim, dtype=torch.float32, device=device)
                window = torch.zeros(batch, cfg.gdn_conv_dim, cfg.linear_conv_kernel_dim - 1, dtype=dtype, device=device)
                self.gdn[i] = (state, window)

    def reset(self) -> None:
        """Start a new sequence: recurrent state and conv window back to zero (K/V slots are overwritten
        before they are read, since attention masks keys beyond each query's position)."""
        for state, window in self.gdn.values():
            state.zero_()
            window.zero_()

    def row(self, b: int) -> "ModelCache":
        """A batch-1 view of batch row ``b``: reads and writes through it land in this cache's buffers."""
        view = object.__new__(ModelCache)
        view.max_len = self.max_len
        view.attention = {i: (k[b : b + 1], v[b : b + 1]) for i, (k, v) in self.attention.items()}
        view.gdn = {i: (s[b : b + 1], w[b : b + 1]) for i, (s, w) in self.gdn.items()}
        return view

    def nbytes(self) -> int:
        tensors = [t for pair in (*self.attention.values(), *self.gdn.values()) for t in pair]
        return sum(t.numel() * t.element_size() for t in tensors)
