"""Pure-PyTorch twin of tree attention: SDPA over [cache | tree keys] with a boolean mask.

Node i (RoPE position L + depth(i)) attends to the L committed cache keys and to the keys of its
ancestors and itself, which is exactly plain causal attention over the cache followed by its root→node path.

Shapes: q ``[B, N, H, D]``; k_cache, v_cache ``[B, S, Hkv, D]`` (slots ≥ L ignored); cache_len L an int or
``[B]`` tensor; k_tree, v_tree ``[B, N, Hkv, D]``; ancestor bitsets ``[B, N, ceil(N/64)]`` int64; GQA with
query head h reading kv head ``h // (H/Hkv)``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash_tfm.tree import unpack_bitsets


def check_tree_attention_inputs(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_tree: torch.Tensor, v_tree: torch.Tensor,
    ancestor_bitsets: torch.Tensor, gate: torch.Tensor | None = None,
) -> tuple[int, int, int, int, int, int]:
    """Validate shapes (no host sync) and return ``(B, N, H, Hkv, D, S)``."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B, N, H, D], got {tuple(q.shape)}")
    B, N, H, D = q.shape
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or k_cache.shape[0] != B or k_cache.shape[3] != D:
        raise ValueError(f"k_cache and v_cache must be [{B}, S, Hkv, {D}], got "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    S, Hkv = k_cache.shape[1], k_cache.shape[2]
    if H % Hkv != 0:
        raise ValueError(f"query heads {H} must be a multiple of kv heads {Hkv}")
    if tuple(k_tree.shape) != (B, N, Hkv, D) or v_tree.shape != k_tree.shape:
        raise ValueError(f"k_tree and v_tree must be [{B}, {N}, {Hkv}, {D}], got "
                         f"{tuple(k_tree.shape)}, {tuple(v_tree.shape)}")
    words = -(-N // 64)
    if tuple(ancestor_bitsets.shape) != (B, N, words) or ancestor_bitsets.dtype != torch.int64:
        raise ValueError(f"ancestor_bitsets must be int64 [{B}, {N}, {words}], got "
                         f"{ancestor_bitsets.dtype} {tuple(ancestor_bitsets.shape)}")
    if gate is not None and gate.shape != q.shape:
        raise ValueError(f"gate must be q's shape {tuple(q.shape)}, got {tuple(gate.shape)}")
    return B, N, H, Hkv, D, S


def cache_lengths(cache_len: int | torch.Tensor, B: int, device: torch.device) -> torch.Tensor:
    """``[B]`` long tensor of committed lengths from an int or a tensor (no host sync)."""
    if isinstance(cache_len, torch.Tensor):
        return cache_len.to(device=device, dtype=torch.long).reshape(-1).expand(B)
    return torch.full((B,), int(cache_len), dtype=torch.long, device=device)


def tree_attention_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_len: int | torch.Tensor,
    k_tree: torch.Tensor, v_tree: torch.Tensor, ancestor_bitsets: torch.Tensor, scale: float | None = None,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """SDPA in fp32 with mask ``[cache slot < L | j ∈ anc⁺(i)]``. Returns ``o [B, N, H, D]`` in q's dtype, or
    with ``gate`` (q's shape) ``o · sigmoid(gate)``, computed in fp32 from the rounded o."""
    B, N, H, Hkv, D, S = check_tree_attention_inputs(q, k_cache, v_cache, k_tree, v_tree, ancestor_bitsets, gate)
    scale = D**-0.5 if scale is None else scale
    if isinstance(cache_len, int):  # slots from cache_len on are masked: reading them only costs (CPU decoding)
        S, k_cache, v_cache = cache_len, k_cache[:, :cache_len], v_cache[:, :cache_len]
    L = cache_lengths(cache_len, B, q.device)
    in_cache = (torch.arange(S, device=q.device) < L[:, None])[:, None, :].expand(B, N, S)
    mask = torch.cat([in_cache, unpack_bitsets(ancestor_bitsets, N)], dim=-1)       # [B, N, S + N]
    keys = torch.cat([k_cache, k_tree], dim=1).float()
    values = torch.cat([v_cache, v_tree], dim=1).float()
    o = F.scaled_dot_product_attention(q.float().transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                       attn_mask=mask[:, None], scale=scale, enable_gqa=H != Hkv)
    o = o.transpose(1, 2).to(q.dtype)
    return o if gate is None else sigmoid_gate_reference(o, gate)


def sigmoid_gate_reference(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``o · sigmoid(gate)`` in fp32, rounded once to o's dtype: what the model's fused gate computes."""
    return (o.float() * torch.sigmoid(gate.float())).to(o.dtype)
