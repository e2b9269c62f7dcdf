"""Softmax attention layer with a static KV cache: plain (Llama/Qwen3) or gated (Qwen3.5/Qwen3-Next).

Projections are fused into one `qkv_proj` matrix laid out [q rows | k rows | v rows]; for gated attention
the q rows are the checkpoint's `q_proj` unchanged, i.e. per head [query (D) | gate (D)].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_tfm.config import ModelConfig
from dflash_tfm.kernels.attention.reference import sigmoid_gate_reference
from dflash_tfm.kernels.attention.tree_attention import tree_attention
from dflash_tfm.layers.compile import fuse_on_cuda
from dflash_tfm.layers.linear import linear, projection_weight
from dflash_tfm.layers.norm import RMSNorm, rms_norm
from dflash_tfm.layers.rotary import RotaryEmbedding, apply_rotary, apply_rotary_to_keys
from dflash_tfm.tuning import TunedChoice


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.gated = cfg.attn_output_gate
        self.q_size = cfg.num_heads * cfg.head_dim * (2 if self.gated else 1)
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = projection_weight(self.q_size + 2 * self.kv_size, cfg.hidden_size)
        self.o_proj = projection_weight(cfg.hidden_size, cfg.num_heads * cfg.head_dim)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_plus_one) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_plus_one) if cfg.qk_norm else None
        self.scale = cfg.head_dim**-0.5

    @property
    def in_weight(self) -> torch.Tensor:
        """The input projection: the decoder applies it (fused with the norm before it at decode)."""
        return self.qkv_proj

    def project(
        self, qkv: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """qkv [B, T, q|k|v] (the normed input times `in_weight`) -> q [B, T, H, D], k, v [B, T, Hkv, D] (normed,
        rotated) and the output gate [B, T, H, D] (a strided view of qkv: nothing copies it)."""
        B, T, _ = qkv.shape
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        gate = None
        if self.gated:
            q, gate = q.view(B, T, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = q.reshape(B, T, self.num_heads, self.head_dim)
        k = k.view(B, T, self.num_kv_heads, self.head_dim)
        v = v.view(B, T, self.num_kv_heads, self.head_dim)
        norms = (None, None, 0.0, False) if self.q_norm is None else (
            self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.q_norm.plus_one)
        q, k = qk_norm_rope(q, k, *norms, rope.cos_table, rope.sin_table, positions, rope.rotary_dim)
        return q, k, v, gate

    def output_gate(self, o: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """o [B, T, H, D] -> o_proj's input [B, T, H·D], through the sigmoid gate (if any)."""
        return o.reshape(*o.shape[:2], -1) if gate is None else sigmoid_gate(o, gate)

    def forward(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        kv_len: int,
    ) -> torch.Tensor:
        """Causal attention of T new tokens (their projections qkv [B, T, q|k|v]) at `positions` over cache
        slots [0, kv_len).

        The new K/V are written into the cache at their positions first; keys beyond a query's position are
        masked, so `kv_len` may be any static bound >= positions.max() + 1 (CUDA graphs use a bucket size).
        k_cache / v_cache: [B, S, Hkv, D]. A single new token on CUDA goes through `decode_attention`.
        """
        q, k, v, gate = self.project(qkv, positions, rope)
        write_kv(k, v, positions, k_cache, v_cache)
        keys, values = k_cache[:, :kv_len], v_cache[:, :kv_len]
        if qkv.shape[1] == 1 and qkv.is_cuda:
            o = decode_attention(q, k, v, keys, values, positions, self.scale)
        else:
            o = causal_cache_attention(q, keys, values, positions, self.scale)
        o = self.output_gate(o, gate)
        return linear(o, self.o_proj)

    def verify(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cache_len: int,
        ancestors: torch.Tensor,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Tree nodes (their projections qkv [B, N, q|k|v]) at `positions` (L + depth) attend to the L cached
        keys plus their ancestors-and-self (`ancestors` bitsets [B, N, W]). The cache is only read; the nodes'
        K/V are returned for `commit`. The output gate, if any, is applied by the attention kernel itself."""
        q, k, v, gate = self.project(qkv, positions, rope)
        o = verify_attention(q, k, v, k_cache, v_cache, cache_len, ancestors, self.scale, gate)
        return linear(o.reshape(*o.shape[:2], -1), self.o_proj), (k, v)


@fuse_on_cuda
def qk_norm_rope(
    q: torch.Tensor, k: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
    plus_one: bool, cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor, rotary_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head q/k RMSNorm (if the model has it) then RoPE, as one fusable function."""
    if q_norm is not None:
        q, k = rms_norm.__wrapped__(q, q_norm, eps, plus_one), rms_norm.__wrapped__(k, k_norm, eps, plus_one)
    return apply_rotary(q, k, cos_table, sin_table, positions, rotary_dim)


@fuse_on_cuda
def k_norm_rope(
    k: torch.Tensor, k_norm: torch.Tensor, eps: float, plus_one: bool, cos_table: torch.Tensor,
    sin_table: torch.Tensor, positions: torch.Tensor, rotary_dim: int,
) -> torch.Tensor:
    """:func:`qk_norm_rope` of keys alone (a drafter's context keys)."""
    return apply_rotary_to_keys(rms_norm.__wrapped__(k, k_norm, eps, plus_one), cos_table, sin_table, positions,
                                rotary_dim)


@fuse_on_cuda
def sigmoid_gate(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """o, gate [B, T, H, D] (gate strided) -> o · sigmoid(gate) as [B, T, H·D], in fp32 like the tree kernel."""
    return sigmoid_gate_reference(o, gate).reshape(*o.shape[:2], -1)


@fuse_on_cuda
def write_kv(k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Scatter k, v [B, T, Hkv, D] into the caches [B, S, Hkv, D] at `positions` [B, T] (graph-safe; fused on
    CUDA into one kernel that stores into both caches in place)."""
    batch = torch.arange(k.shape[0], device=k.device).unsqueeze(1).expand_as(positions)
    k_cache.index_put_((batch, positions), k.to(k_cache.dtype))
    v_cache.index_put_((batch, positions), v.to(v_cache.dtype))


DECODE_SPLITS = 32
MIN_KEYS_PER_DECODE_SPLIT = 32  # one key tile of the tree kernel at head dim > 128


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    positions: torch.Tensor, scale: float,
) -> torch.Tensor:
    """One new token per row (q [B, 1, H, D], its k, v [B, 1, Hkv, D] already written at `positions` [B, 1]) on
    CUDA: the split-KV tree-attention kernel with the token as a one-node tree over the cache's first
    `positions` slots, in `DECODE_SPLITS` cache splits (fewer for a short cache: at least
    `MIN_KEYS_PER_DECODE_SPLIT` keys each). On the H200 that beat SDPA and every other split count at both
    key-length buckets the 27B decode step was timed at (2048 keys: 8.7 µs against SDPA's 11.1, 16 splits 9.5;
    8192 keys: 12.1 against 17.1; docs/data/perf/ar_decode_h200_2026-12-03*.json)."""
    itself = torch.ones(q.shape[0], 1, 1, dtype=torch.long, device=q.device)  # ancestor bitset: bit 0
    splits = max(1, min(DECODE_SPLITS, k_cache.shape[1] // MIN_KEYS_PER_DECODE_SPLIT))
    splits = 1 << (splits.bit_length() - 1)  # a power of two
    return tree_attention(q, k_cache, v_cache, positions[:, 0], k, v, itself, scale, num_splits=splits)


# The tree kernel's tiles the verify's tuned choice times besides its own split heuristic ("tree_kernel"), as
# tree_attention keyword arguments: those that won a tree size on the H200. In the model (1536 cached keys,
# docs/data/perf/verify_step_h200_2026-12-0[34]*.json): 16 cache splits at N = 1 and 16 (13.5 against the heuristic's 16.7 µs
# at N = 16), 4 splits of 64-key tiles at N = 65 (26.2 against 34.7), 2 at N = 129 (41.7 against 56.3). In the
# sweep of the kernel alone (`bench_tree_kernels --attention-sweep`), 128-row tiles (each K/V tile read for twice
# the rows): 8 splits at N = 65, 4 at N = 129, 7–19 % under those. The sweep's other tiles never won.
VERIFY_TILES = {"tree_kernel s16": {"num_splits": 16}, "tree_kernel s4 bn64": {"num_splits": 4, "block_n": 64},
                "tree_kernel s2 bn64": {"num_splits": 2, "block_n": 64},
                "tree_kernel s8 bm128": {"num_splits": 8, "block_m": 128},
                "tree_kernel s4 bm128": {"num_splits": 4, "block_m": 128}}
VERIFY_ATTENTION = TunedChoice("verify_attention", default="tree_kernel",
                               candidates=("tree_kernel", *VERIFY_TILES))
VERIFY_TIMING_KEYS = 2048  # cached keys the candidates are timed over (one verify graph serves every length)


def verify_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    cache_len: int | torch.Tensor, ancestors: torch.Tensor, scale: float, gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """`tree_attention` of the tree nodes (times sigmoid(gate), if given) with its own split heuristic or one of
    `VERIFY_TILES`, the tuned choice for the shape. Fewer splits write fewer fp32 partial outputs for the merge
    (8 splits of a 65-node tree: 13 MB per layer, three times the K/V read at a 1k context), more keep more SMs
    busy. The candidates are timed over `VERIFY_TIMING_KEYS` cached keys rather than the caller's length, which
    changes every step: one choice per tree shape serves every length."""
    def run(tile: dict | None = None, length: int | torch.Tensor = cache_len) -> torch.Tensor:
        return tree_attention(q, k_cache, v_cache, length, k, v, ancestors, scale, gate=gate, **(tile or {}))

    def candidates() -> dict:
        length = torch.full((q.shape[0],), min(k_cache.shape[1], VERIFY_TIMING_KEYS), device=q.device)
        return {"tree_kernel": lambda: run(length=length)} | {
            name: (lambda t=t: run(t, length)) for name, t in VERIFY_TILES.items()}

    key = (*q.shape, min(k_cache.shape[1], VERIFY_TIMING_KEYS), k_cache.shape[2], q.dtype, gate is not None)
    return run(VERIFY_TILES.get(VERIFY_ATTENTION.pick(key, candidates, q.device)))


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool mask (True = visible) -> 0 / -inf in `dtype`: SDPA adds it as is, where a bool mask would be
    converted inside SDPA (two more kernels per layer)."""
    return torch.zeros((), dtype=dtype, device=visible.device).masked_fill(~visible, float("-inf"))


@fuse_on_cuda
def causal_mask(positions: torch.Tensor, num_keys: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [B, 1, T, S] (0 where key slot <= the query's position, else -inf) for queries at
    `positions` [B, T]."""
    keep = torch.arange(num_keys, device=positions.device).view(1, 1, 1, num_keys) <= positions[:, None, :, None]
    return additive_mask(keep, dtype)


def causal_cache_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, T, H, D] at `positions` [B, T]; k, v [B, S, Hkv, D] hold positions 0..S-1 -> [B, T, H, D]."""
    mask = causal_mask(positions, k.shape[1], q.dtype)
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale, enable_gqa=True
    )
    return o.transpose(1, 2)
