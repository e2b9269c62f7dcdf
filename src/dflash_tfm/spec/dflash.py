"""DFlash block drafter (z-lab format) for inference, with a static context K/V cache of one or more rows.

One `draft` runs the block `[root, MASK x (B-1)]` at positions L .. L+B-1 through every layer in a single
pass and returns, for block positions 1 .. B-1, the target lm_head's logits and the final-normed hidden state
(position k predicts token L+k). With several cache rows (`allocate(..., batch=n)`, for batched speculative
decoding) one draft runs the blocks of the first rows together, each row at its own L.

What the reference does with the context (z-lab/dflash `model/dflash.py` and `dflash/model.py`,
`Qwen3DFlashAttention.forward`; SGLang `python/sglang/srt/models/dflash.py`, `DFlashAttention.kv_proj_only`
applied to `project_target_hidden`):
  * ctx = hidden_norm(fc(concat(taps))) is computed ONCE and handed unchanged to every layer; each layer's
    context K/V are that layer's own k_proj / v_proj of the SAME ctx (never the previous layer's output);
  * input_layernorm is applied to the block's hidden states only, NOT to ctx (ctx is already hidden_norm'ed);
  * keys of ctx and block both get k_norm, then RoPE at their absolute positions; values are not normed;
  * queries come from the block only; after a draft the cache is cropped back to the context.
Hence the context K/V of a token never change once computed, and only they are cached here.

Masks follow the reference's rule over absolute positions q (query) and p (key): full-attention layers see
every context key and the whole block; sliding layers see keys with q - p < W, and inside the block either
everything with |q - p| < W (non-causal) or p <= q (causal, `causal_sliding_in_block`). The block's own K/V
are written into the cache at slots L .. L+B-1 as scratch (the next `append_context` overwrites them), so a
draft reads one contiguous cache slice (full layers) or one gathered window (sliding layers) with static
shapes and no host sync: `position` may be a device tensor and the whole step can be captured in a CUDA graph.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from dflash_tfm.config import ModelConfig
from dflash_tfm.kernels import tree_attention
from dflash_tfm.layers.attention import additive_mask, k_norm_rope, qk_norm_rope, write_kv
from dflash_tfm.layers.linear import linear
from dflash_tfm.layers.mlp import SwiGLU
from dflash_tfm.layers.norm import RMSNorm
from dflash_tfm.layers.rotary import RotaryEmbedding
from dflash_tfm.layers.vocab_parallel import vocab_embedding, vocab_logits
from dflash_tfm.errors import CheckpointError, CheckpointNotFoundError
from dflash_tfm.loading.loader import default_dtype
from dflash_tfm.loading.safetensors_dir import SafetensorsDir
from dflash_tfm.loading.weight_map import Piece, TensorSpec
from dflash_tfm.spec.dflash_config import SLIDING_ATTENTION, DFlashConfig, load_dflash_config


class TokenHeads(Protocol):
    """What the drafter borrows from the target: `embed_tokens` and `lm_head_weight` ([V, H], or this rank's
    V / tp rows of a vocab-parallel target) and its config (the vocabulary size V)."""

    embed_tokens: torch.Tensor
    lm_head_weight: torch.Tensor
    config: ModelConfig


class DFlashLayer(nn.Module):
    """One Qwen3-style drafter layer (plain-w RMSNorms, q/k norm, SwiGLU); q|k|v and gate|up are fused."""

    def __init__(self, cfg: DFlashConfig, layer_type: str) -> None:
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        self.sliding = layer_type == SLIDING_ATTENTION
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, D
        self.q_size, self.kv_size = cfg.num_heads * D, cfg.num_kv_heads * D
        self.input_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.qkv_proj = nn.Parameter(torch.empty(self.q_size + 2 * self.kv_size, H))
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.o_proj = nn.Parameter(torch.empty(H, self.q_size))
        self.post_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = SwiGLU(H, cfg.intermediate_size)
        self.scale = D**-0.5

    def context_kv(
        self, ctx: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """ctx [1, T, H] (hidden_norm(fc(taps)), no input norm) at positions [1, T] -> k, v [1, T, Hkv, D]."""
        B, T, _ = ctx.shape
        k, v = linear(ctx, self.qkv_proj[self.q_size :]).split(self.kv_size, dim=-1)
        k = k_norm_rope(k.view(B, T, self.num_kv_heads, self.head_dim), self.k_norm.weight, self.k_norm.eps,
                        self.k_norm.plus_one, rope.cos_table, rope.sin_table, positions, rope.rotary_dim)
        return k, v.view(B, T, self.num_kv_heads, self.head_dim)

    def _norm_rotate(
        self, q: torch.Tensor, k: torch.Tensor, rope: RotaryEmbedding, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q/k norms, then RoPE at `positions`. With the drafter's own tables: one fused function (a kernel on
        CUDA instead of ~12 launches per layer; the norms share the config's eps). Training hands a stand-in
        that maps cache slots to positions first (`train.dflash_forward.SlotRope`): the modules one by one."""
        if isinstance(rope, RotaryEmbedding):
            return qk_norm_rope(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.q_norm.plus_one,
                                rope.cos_table, rope.sin_table, positions, rope.rotary_dim)
        return rope(self.q_norm(q), self.k_norm(k), positions)

    def forward(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: int | torch.Tensor,
        mask: torch.Tensor,
        context_then_block: bool = False,
        causal_in_block: bool = False,
    ) -> torch.Tensor:
        """Block h [b, B, H] at positions [b, B] -> [b, B, H].

        The block's K/V are written to the cache [b, S, Hkv, D] at their positions, then the queries attend to
        cache slots `slots` (an int n: slots 0..n-1; a tensor [b, n]: those slot indices per row) under `mask`
        [b, 1, G*B, n]
        (the block mask repeated for the G query heads of a kv head, see `grouped_attention`).
        `context_then_block` says the mask is exactly "every context slot before the block + the block (all of
        it, or up to the query with `causal_in_block`)", as at inference when no window cuts the keys; then
        `block_attention` may compute it without the mask.
        """
        batch, T, _ = h.shape
        x = self.input_norm(h)
        q, k, v = linear(x, self.qkv_proj).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self._norm_rotate(q.view(batch, T, self.num_heads, self.head_dim),
                                 k.view(batch, T, self.num_kv_heads, self.head_dim), rope, positions)
        v = v.view(batch, T, self.num_kv_heads, self.head_dim)
        write_kv(k, v, positions, k_cache, v_cache)
        if context_then_block and isinstance(slots, int):
            o = block_attention(q, k, v, k_cache, v_cache, positions, slots, mask, self.scale, causal_in_block)
        else:
            if isinstance(slots, int):
                keys, values = k_cache[:, :slots], v_cache[:, :slots]
            else:
                rows = torch.arange(batch, device=slots.device).view(batch, 1)
                keys, values = k_cache[rows, slots], v_cache[rows, slots]
            o = grouped_attention(q, keys, values, mask, self.scale)
        h, x = self.post_norm.add_forward(h, linear(o, self.o_proj))
        return h + self.mlp(x)


def grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [b, T, Hq, D]; k, v [b, S, Hkv, D]; mask [b or 1, 1, G*T, S] with G = Hq / Hkv -> [b, T, Hq*D].

    The G query heads sharing a kv head are stacked along the query axis, so SDPA sees plain attention with
    Hkv heads and G*T queries: no K/V repeat, and every SDPA backend that takes a mask applies.
    """
    b, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    qg = q.view(b, T, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(b, Hkv, G * T, D)
    o = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale)
    return o.view(b, Hkv, G, T, D).permute(0, 3, 1, 2, 4).reshape(b, T, Hq * D)


# Where the block attention runs as the split-KV tree kernel (see `block_attention`).
TREE_KERNEL_DEVICES = ("cuda",)


@lru_cache(maxsize=None)
def block_bitsets(batch: int, T: int, causal: bool, device: torch.device) -> torch.Tensor:
    """Ancestor bitsets [batch, T, 1] of the block as a tree: a chain when `causal`, else every node sees every
    node. The same for every layer and every draft, so built once and only read afterwards; the first call is
    never under a capture (`PhaseGraphs` runs a phase eagerly first)."""
    node = torch.arange(T, device=device)
    seen = (1 << (node + 1)) - 1 if causal else torch.full_like(node, (1 << T) - 1)
    return seen.view(1, T, 1).expand(batch, T, 1).contiguous()


def block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    positions: torch.Tensor, kv_len: int, mask: torch.Tensor, scale: float, causal_in_block: bool = False,
) -> torch.Tensor:
    """Draft attention of the blocks (q [b, B, Hq, D]; their k, v [b, B, Hkv, D], already written at `positions`
    [b, B] = L .. L+B-1 of each row) over the context slots [0, L) and the block (all of it, or up to each query
    with `causal_in_block`), which `mask` [b, 1, G*B, kv_len] also says -> [b, B, Hq * D].

    On CUDA, for blocks of up to 63 queries (one int64 bitset word per node), the split-KV tree-attention kernel
    with the block as a tree (a chain when causal, else every node sees every node): on the H200 it took 10.6 µs
    per layer where masked SDPA took 53 (docs/data/perf/spec_step_h200_2026-12-03*.json), since SDPA gives cuDNN only Hkv
    programs and no split over the keys. Elsewhere masked SDPA over the first `kv_len` cache slots
    (`grouped_attention`)."""
    if q.device.type in TREE_KERNEL_DEVICES and q.shape[1] <= 63:
        b, T, Hq, D = q.shape
        bits = block_bitsets(b, T, causal_in_block, q.device)
        return tree_attention(q, k_cache, v_cache, positions[:, 0], k, v, bits, scale).reshape(b, T, Hq * D)
    return grouped_attention(q, k_cache[:, :kv_len], v_cache[:, :kv_len], mask, scale)


def attention_mask(
    qpos: torch.Tensor, kpos: torch.Tensor, window: int | None, causal: bool
) -> torch.Tensor:
    """Which keys each block query sees: qpos [b, B] and kpos [b or 1, S] absolute positions -> bool
    [b, 1, B, S].

    Keys must exist (kpos >= 0) and lie before the block's end (later slots are stale); sliding layers add
    q - p < W, and p - q < W too unless causal; `causal` adds p <= q.
    """
    d = qpos[:, :, None] - kpos[:, None, :]
    visible = ((kpos >= 0) & (kpos <= qpos[:, -1:]))[:, None, :].expand_as(d)
    if causal:
        visible = visible & (d >= 0)
    if window is not None:
        visible = visible & (d < window) & (-d < window)
    return visible.unsqueeze(1)


class DFlashDrafter(nn.Module):
    """The drafter's own weights plus references to the target's embeddings and lm_head (never copied).

    Parameters live on the device and in the dtype of the target's `embed_tokens`; `loading` fills them
    (`load_dflash_drafter`) or `init_random_` does. Context K/V caches are `[batch, max_len, Hkv, D]` per layer.
    """

    def __init__(self, cfg: DFlashConfig, target: TokenHeads, max_len: int | None = None, batch: int = 1) -> None:
        super().__init__()
        self.config = cfg
        embed = target.embed_tokens
        # A plain tuple keeps the shared tensors out of this module's parameters and state_dict.
        self._shared = (embed, target.lm_head_weight)
        self.vocab_size = target.config.vocab_size
        self.device, self.dtype = embed.device, embed.dtype
        with torch.device(self.device), default_dtype(self.dtype):
            self.fc = nn.Parameter(torch.empty(cfg.hidden_size, cfg.num_taps * cfg.hidden_size))
            self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.layers = nn.ModuleList(DFlashLayer(cfg, t) for t in cfg.layer_types)
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        B = cfg.block_size
        self.register_buffer("_mask_ids", torch.full((B - 1,), cfg.mask_token_id, device=self.device), persistent=False)
        self.register_buffer("_block_offsets", torch.arange(B, device=self.device), persistent=False)
        self.requires_grad_(False).eval()
        self.max_len, self.batch = 0, 0
        self.caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        if max_len:
            self.allocate(max_len, batch=batch)

    @property
    def embed_tokens(self) -> torch.Tensor:
        return self._shared[0]

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self._shared[1]

    def allocate(self, max_len: int, device: torch.device | str | None = None, batch: int = 1) -> None:
        """(Re)allocate the static context caches (`batch` rows, one per sequence) and RoPE tables for positions
        0 .. max_len-1 (context plus the block being drafted). `device` defaults to the target's and must match."""
        if device is not None and torch.device(device).type != self.device.type:
            raise ValueError(f"drafter caches must live with the target's embeddings on {self.device}, not {device}")
        cfg = self.config
        shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
        self.caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device), torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in self.layers
        ]
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.head_dim, cfg.rope, max_len, "drafter").to(self.device)
        self.register_buffer("_slots", torch.arange(max_len, device=self.device), persistent=False)
        self.max_len, self.batch = max_len, batch

    def reset(self) -> None:
        """Start a new request. Not needed for correctness (a draft writes its block's slots before reading them
        and masks every slot past the block); zeroing keeps masked slots finite, since a NaN there would
        still poison SDPA's weighted sum."""
        for k, v in self.caches:
            k.zero_()
            v.zero_()

    def append_context(self, taps: list[torch.Tensor] | torch.Tensor, start: int | torch.Tensor,
                       first_row: int = 0) -> None:
        """Cache the context K/V of T newly committed tokens at positions start .. start+T-1, in cache rows
        first_row .. first_row + b - 1.

        taps: the target's tap-layer outputs for those tokens, K tensors [b, T, H_target] in
        `target_layer_ids` order, or their concatenation [b, T, K*H_target]; start: an int or a tensor of one
        start per row ([b], or [1] for all).
        """
        feats = taps if isinstance(taps, torch.Tensor) else torch.cat(taps, dim=-1)
        b, T = feats.shape[:2]
        if feats.shape[-1] != self.fc.shape[1]:
            raise ValueError(f"context features have width {feats.shape[-1]}, the drafter's fc expects {self.fc.shape[1]}")
        if not self.caches:
            raise RuntimeError("call allocate(max_len) before append_context")
        if isinstance(start, int) and start + T > self.max_len:
            raise ValueError(f"context positions up to {start + T - 1} exceed the drafter cache (max_len {self.max_len})")
        if first_row + b > self.batch:
            raise ValueError(f"rows {first_row} .. {first_row + b - 1} exceed the drafter cache's {self.batch}")
        ctx = self.hidden_norm(linear(feats.to(self.dtype), self.fc))
        first = start.view(-1, 1) if isinstance(start, torch.Tensor) else start
        positions = (torch.arange(T, device=self.device) + first).expand(b, T)
        for layer, (k_cache, v_cache) in zip(self.layers, self.caches):
            k, v = layer.context_kv(ctx, positions, self.rope)
            write_kv(k, v, positions, k_cache[first_row : first_row + b], v_cache[first_row : first_row + b])

    def draft(
        self, root_token: torch.Tensor, position: int | torch.Tensor, kv_len: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One block draft per row of the first b cache rows: root_token [b] long (not yet in any cache) at
        `position` L (an int, or a tensor [b] of each row's L, or [1] for all), context [0, L) cached.

        kv_len: static number of cache slots full-attention layers read (>= L + B; default max_len); fix it
        per CUDA graph (e.g. a power-of-two bucket). Returns fp32 logits [b, B-1, V] and the final-normed
        hidden states [b, B-1, H] of block positions 1 .. B-1.
        """
        B = self.config.block_size
        kv_len = self.max_len if kv_len is None else kv_len
        if not self.caches or kv_len > self.max_len:
            raise ValueError(f"kv_len {kv_len} exceeds the allocated drafter cache (max_len {self.max_len})")
        if isinstance(position, int) and position + B > kv_len:
            raise ValueError(f"a block at position {position} needs kv_len >= {position + B}, got {kv_len}")
        rows = root_token.numel()
        if rows > self.batch:
            raise ValueError(f"{rows} blocks exceed the drafter cache's {self.batch} rows")
        ids = torch.cat((root_token.view(rows, 1).to(self._mask_ids.dtype), self._mask_ids.expand(rows, B - 1)), dim=1)
        h = vocab_embedding(ids, self.embed_tokens, self.vocab_size)
        if self.config.input_embedding_scale != 1.0:
            h = h * self.config.input_embedding_scale
        first = position.view(-1, 1) if isinstance(position, torch.Tensor) else position
        qpos = (self._block_offsets + first).expand(rows, B)  # [b, B]
        keys = {sliding: self._key_set(qpos, kv_len, sliding) for sliding in {layer.sliding for layer in self.layers}}
        cfg = self.config
        # every slot < kv_len is within the window of every query (or sliding layers have no window)
        unwindowed = cfg.sliding_window is None or kv_len <= cfg.sliding_window
        for layer, (k_cache, v_cache) in zip(self.layers, self.caches):
            h = layer(h, qpos, self.rope, k_cache[:rows], v_cache[:rows], *keys[layer.sliding],
                      context_then_block=not layer.sliding or unwindowed,
                      causal_in_block=layer.sliding and cfg.causal_sliding_in_block)
        hidden = self.norm(h)[:, 1:]
        return self.logits(hidden), hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of final-normed drafter hidden states through the target's lm_head, times the config's
        `output_multiplier` and soft-capped by `final_logit_softcapping` (the reference's `compute_logits`, done in
        fp32 rather than the model dtype)."""
        logits = vocab_logits(hidden, self.lm_head_weight, self.vocab_size)
        cfg = self.config
        if cfg.output_multiplier != 1.0:
            logits = logits * cfg.output_multiplier
        if cfg.final_logit_softcapping is not None:
            logits = torch.tanh(logits / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
        return logits

    def _key_set(self, qpos: torch.Tensor, kv_len: int, sliding: bool) -> tuple[int | torch.Tensor, torch.Tensor]:
        """Cache slots a layer reads and their mask. Sliding layers gather only the W-1 context slots before
        the block plus the block when that is fewer than kv_len (long contexts); otherwise read [0, kv_len)."""
        cfg = self.config
        window = cfg.sliding_window if sliding else None
        causal = sliding and cfg.causal_sliding_in_block
        groups = cfg.num_heads // cfg.num_kv_heads
        if window is not None and window - 1 + cfg.block_size < kv_len:
            kpos = qpos[:, :1] - (window - 1) + self._slots[: window - 1 + cfg.block_size]  # [b, n]
            slots: int | torch.Tensor = kpos.clamp(min=0)
        else:
            slots, kpos = kv_len, self._slots[:kv_len].view(1, -1)
        # built once per draft for all layers, additive (see `additive_mask`)
        return slots, additive_mask(attention_mask(qpos, kpos, window, causal).repeat(1, 1, groups, 1), self.dtype)


def _to(param: str, row: int = 0) -> Callable[[torch.Tensor], list[Piece]]:
    return lambda t: [(param, row, t)]


def checkpoint_tensors(cfg: DFlashConfig) -> dict[str, TensorSpec]:
    """Checkpoint tensor name (z-lab format, no prefix) -> expected shape and where it lands in our params."""
    H, D, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * D, cfg.num_kv_heads * D
    specs = {
        "fc.weight": TensorSpec((H, cfg.num_taps * H), _to("fc")),
        "hidden_norm.weight": TensorSpec((H,), _to("hidden_norm.weight")),
        "norm.weight": TensorSpec((H,), _to("norm.weight")),
    }
    for i in range(cfg.num_layers):
        src, dst = f"layers.{i}.", f"layers.{i}."
        specs.update({
            f"{src}self_attn.q_proj.weight": TensorSpec((q, H), _to(f"{dst}qkv_proj", 0)),
            f"{src}self_attn.k_proj.weight": TensorSpec((kv, H), _to(f"{dst}qkv_proj", q)),
            f"{src}self_attn.v_proj.weight": TensorSpec((kv, H), _to(f"{dst}qkv_proj", q + kv)),
            f"{src}self_attn.o_proj.weight": TensorSpec((H, q), _to(f"{dst}o_proj")),
            f"{src}self_attn.q_norm.weight": TensorSpec((D,), _to(f"{dst}q_norm.weight")),
            f"{src}self_attn.k_norm.weight": TensorSpec((D,), _to(f"{dst}k_norm.weight")),
            f"{src}mlp.gate_proj.weight": TensorSpec((I, H), _to(f"{dst}mlp.gate_up", 0)),
            f"{src}mlp.up_proj.weight": TensorSpec((I, H), _to(f"{dst}mlp.gate_up", I)),
            f"{src}mlp.down_proj.weight": TensorSpec((H, I), _to(f"{dst}mlp.down")),
            f"{src}input_layernorm.weight": TensorSpec((H,), _to(f"{dst}input_norm.weight")),
            f"{src}post_attention_layernorm.weight": TensorSpec((H,), _to(f"{dst}post_norm.weight")),
        })
    return specs


def load_dflash_drafter(
    path: str | Path,
    target_model: TokenHeads,
    target_cfg: ModelConfig,
    device: torch.device | str,
    dtype: torch.dtype,
    max_len: int | None = None,
    causal_sliding_in_block: bool | None = None,
    batch: int = 1,
) -> DFlashDrafter:
    """Load a z-lab DFlash drafter directory (config.json + safetensors) for `target_model`, strictly.

    Every check runs on the config and the shard headers before a tensor is read: the drafter must fit the
    target (`DFlashConfig.check_fits`) and the tensors must be exactly the expected set with the expected
    shapes. The drafter runs in the target's dtype and on its device (`device`, `dtype` must agree); its context
    caches hold `batch` rows of `max_len` positions.
    """
    cfg = load_dflash_config(path, causal_sliding_in_block)
    try:
        source = SafetensorsDir(path)
    except FileNotFoundError as e:
        raise CheckpointNotFoundError(f"DFlash drafter: {e}") from None
    names = set(source.tensor_names())
    fc_shape = source.tensor_shape("fc.weight") if "fc.weight" in names else ()
    cfg.check_fits(target_cfg, fc_shape[1] if len(fc_shape) == 2 else None)
    specs = checkpoint_tensors(cfg)
    problems = []
    for name in sorted(names):
        found = list(source.tensor_shape(name))
        if name not in specs:
            problems.append(f"unexpected tensor {name!r} (shape {found})")
        elif tuple(found) != specs[name].shape:
            problems.append(f"tensor {name!r}: expected shape {list(specs[name].shape)}, found {found}")
    problems += [f"missing tensor {n!r} (expected shape {list(specs[n].shape)})" for n in sorted(set(specs) - names)]
    if problems:
        raise CheckpointError(f"DFlash drafter checkpoint {path} does not match its config:\n  " + "\n  ".join(problems))
    embed = target_model.embed_tokens
    if embed.dtype != dtype or embed.device.type != torch.device(device).type:
        raise ValueError(
            f"the drafter runs with the target's embeddings ({embed.dtype} on {embed.device}); got {dtype} on {device}"
        )
    drafter = DFlashDrafter(cfg, target_model, max_len, batch)
    params = dict(drafter.named_parameters())
    with torch.no_grad():
        for name, spec in specs.items():
            for param_name, row, piece in spec.assign(source.load_tensor(name, dtype)):
                params[param_name][row : row + piece.shape[0]].copy_(piece)
    return drafter
