"""Static per-request caches of the target: attention K/V up to the max length, GDN state and conv window.

Allocated once per engine (the leading dim of each per-layer tensor is the batch) and reused across requests,
so the CUDA graphs that read them never see a new address. Each kind is ONE layer-major stacked tensor
(`k`, `v`, `states`, `windows`) and the per-layer entries are views of it, so a commit can update every layer
of a kind in a single kernel launch.
"""
from __future__ import annotations

import torch

from dflash_tfm.config import FULL_ATTENTION, ModelConfig
from dflash_tfm.layers.gated_deltanet import GDNCommitStacks


class ModelCache:
    """attention[i] = (k [B, S, Hkv, D], v [B, S, Hkv, D]); gdn[i] = (state [B, HV, dk, dv] fp32, window [B, C, K-1]),
    views of k, v [La, B, S, Hkv, D] and states, windows [Lg, B, ...] in the order of `attention_layers` /
    `gdn_layers` (decoder layer indices)."""

    def __init__(self, cfg: ModelConfig, max_len: int, batch: int, dtype: torch.dtype, device: torch.device) -> None:
        self.max_len = max_len
        self.config = cfg
        self._commit_stacks: dict[int, GDNCommitStacks] = {}
        self.attention_layers = [i for i, t in enumerate(cfg.layer_types) if t == FULL_ATTENTION]
        self.gdn_layers = [i for i, t in enumerate(cfg.layer_types) if t != FULL_ATTENTION]
        kv_shape = (len(self.attention_layers), batch, max_len, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(kv_shape, dtype=dtype, device=device)
        self.v = torch.zeros(kv_shape, dtype=dtype, device=device)
        n_gdn = len(self.gdn_layers)
        if n_gdn:
            self.states = torch.zeros(n_gdn, batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                      cfg.linear_value_head_dim, dtype=torch.float32, device=device)
            self.windows = torch.zeros(n_gdn, batch, cfg.gdn_conv_dim, cfg.linear_conv_kernel_dim - 1, dtype=dtype, device=device)
        else:
            self.states = self.windows = torch.zeros(0, batch, device=device)
        self._index_layers()

    def gdn_commit_stacks(self, nodes: int) -> GDNCommitStacks:
        """The buffers a verify pass over `nodes` tree nodes writes its GDN commit context into: allocated on
        first use per tree size, then reused (static addresses for the CUDA graphs that write and read them)."""
        if nodes not in self._commit_stacks:
            self._commit_stacks[nodes] = GDNCommitStacks.allocate(
                self.config, self.gdn_layers, self.states.shape[1], nodes, self.windows.dtype, self.states.device)
        return self._commit_stacks[nodes]

    def _index_layers(self) -> None:
        self.attention = {i: (self.k[j], self.v[j]) for j, i in enumerate(self.attention_layers)}
        self.gdn = {i: (self.states[j], self.windows[j]) for j, i in enumerate(self.gdn_layers)}

    def reset(self) -> None:
        """Start a new sequence: recurrent state and conv window back to zero (K/V slots are overwritten
        before they are read, since attention masks keys beyond each query's position)."""
        self.states.zero_()
        self.windows.zero_()

    def row(self, b: int) -> "ModelCache":
        """A batch-1 view of batch row ``b``: reads and writes through it land in this cache's buffers."""
        return self.rows(b, b + 1)

    def rows(self, start: int, stop: int) -> "ModelCache":
        """A view of batch rows ``start:stop``: a batched step over the first rows only (continuous batching
        runs the smallest batch bucket covering its busy rows) reads and writes this cache's buffers."""
        view = object.__new__(ModelCache)
        view.max_len, view.config = self.max_len, self.config
        view._commit_stacks = {}
        view.attention_layers, view.gdn_layers = self.attention_layers, self.gdn_layers
        view.k, view.v = self.k[:, start:stop], self.v[:, start:stop]
        view.states, view.windows = self.states[:, start:stop], self.windows[:, start:stop]
        view._index_layers()
        return view

    def nbytes(self) -> int:  # the caches proper; commit stacks are verify scratch
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.states, self.windows))
