"""Which checkpoint tensors a target needs, their shapes, and where each lands in our fused parameters.

Format quirks live here, not in the forward pass: q/k/v and gate/up are concatenated into one matrix,
the four GDN input projections into one `in_proj`, Qwen3-Next's head-grouped `in_proj_qkvz` / `in_proj_ba`
are regrouped into the Qwen3.5 order, and the conv weight loses its singleton dim. A mixture-of-experts layer's
router, shared-expert gate and shared gate / up go into one `in_proj`, and its experts into two stacks, from
either layout they are stored in: fused (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`
[E, H, I], as transformers holds them) or one tensor per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`,
as transformers saves them and Qwen3-Next was released).

At tensor-parallel size > 1 each spec also says which rows or columns of its tensor this rank reads (`part`,
`parallel/sharding.py`), and `assign` places that slice at the offsets of the rank's smaller parameters.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Collection

import torch

from dflash_tfm.config import FULL_ATTENTION, ModelConfig
from dflash_tfm.parallel.sharding import Part, Shard, shard_config, vocab_rows

# (our parameter name, first row in it, the rows to write there); a parameter with more than two dims counts
# rows over all but its last dim ([E, 2I, H]: E · 2I rows of H), as do the rows written.
Piece = tuple[str, int, torch.Tensor]

# Checkpoint entries that are not part of the text decoder: vision tower, multi-token-prediction head,
# and rotary caches some older checkpoints saved.
IGNORED = re.compile(r"^(model\.visual\.|visual\.|mtp\.|model\.mtp\.)|rotary_emb\.inv_freq$")


@dataclass(frozen=True)
class TensorSpec:
    """One expected checkpoint tensor: its shape, the slice this rank reads (None: all of it) and how to split
    what is read into our parameters."""

    shape: tuple[int, ...]
    assign: Callable[[torch.Tensor], list[Piece]]
    part: Part | None = None

    @property
    def read_shape(self) -> tuple[int, ...]:
        """The shape of what this rank reads: `shape` with the part's ranges in place of its dim."""
        if self.part is None:
            return self.shape
        dim, ranges = self.part
        shape = list(self.shape)
        shape[dim % len(shape)] = sum(n for _, n in ranges)
        return tuple(shape)


def _to(param: str, row: int = 0) -> Callable[[torch.Tensor], list[Piece]]:
    return lambda t: [(param, row, t)]


def expected_tensors(cfg: ModelConfig, stored: Collection[str] = (), shard: Shard = Shard()) -> dict[str, TensorSpec]:
    """Map of checkpoint tensor name -> spec for every tensor the model needs. `stored` (the checkpoint's tensor
    names) picks each mixture-of-experts layer's expert layout: fused when it holds that layer's fused tensors,
    else one tensor per expert. `shard` is this rank's place among the tensor-parallel ranks."""
    H, p, V = cfg.hidden_size, cfg.weight_prefix, cfg.vocab_size
    vocab_part = shard.part(0, shard.block(V)) if vocab_rows(V, shard.size) < V else None  # vocab-parallel rows
    specs: dict[str, TensorSpec] = {
        f"{p}embed_tokens.weight": TensorSpec((V, H), _to("embed_tokens"), vocab_part),
        f"{p}norm.weight": TensorSpec((H,), _to("norm.weight")),
    }
    if not cfg.tie_word_embeddings:
        specs["lm_head.weight"] = TensorSpec((V, H), _to("lm_head"), vocab_part)
    for i, layer_type in enumerate(cfg.layer_types):
        src, dst = f"{p}layers.{i}.", f"layers.{i}."
        specs[f"{src}input_layernorm.weight"] = TensorSpec((H,), _to(f"{dst}input_norm.weight"))
        specs[f"{src}post_attention_layernorm.weight"] = TensorSpec((H,), _to(f"{dst}post_norm.weight"))
        if i in cfg.moe_layers:
            specs.update(_moe_specs(cfg, src + "mlp.", dst + "mlp.", stored, shard))
        else:
            I = cfg.intermediate_size
            rows, cols = shard.part(0, shard.block(I)), shard.part(1, shard.block(I))
            local = I // shard.size
            specs[f"{src}mlp.gate_proj.weight"] = TensorSpec((I, H), _to(f"{dst}mlp.gate_up", 0), rows)
            specs[f"{src}mlp.up_proj.weight"] = TensorSpec((I, H), _to(f"{dst}mlp.gate_up", local), rows)
            specs[f"{src}mlp.down_proj.weight"] = TensorSpec((H, I), _to(f"{dst}mlp.down"), cols)
        if layer_type == FULL_ATTENTION:
            specs.update(_attention_specs(cfg, src + "self_attn.", dst + "mixer.", shard))
        else:
            specs.update(_gdn_specs(cfg, src + "linear_attn.", dst + "mixer.", shard))
    return specs


def _attention_specs(cfg: ModelConfig, src: str, dst: str, shard: Shard) -> dict[str, TensorSpec]:
    H, D = cfg.hidden_size, cfg.head_dim
    q_head = D * (2 if cfg.attn_output_gate else 1)  # a gated head's q rows are [query | gate]
    q_rows, kv_rows = cfg.num_heads * q_head, cfg.num_kv_heads * D
    local = shard_config(cfg, shard)
    local_q, local_kv = local.num_heads * q_head, local.num_kv_heads * D
    kv_part = shard.part(0, shard.kv_block(cfg.num_kv_heads, D))
    specs = {
        f"{src}q_proj.weight": TensorSpec((q_rows, H), _to(f"{dst}qkv_proj", 0),
                                          shard.part(0, shard.block(cfg.num_heads, q_head))),
        f"{src}k_proj.weight": TensorSpec((kv_rows, H), _to(f"{dst}qkv_proj", local_q), kv_part),
        f"{src}v_proj.weight": TensorSpec((kv_rows, H), _to(f"{dst}qkv_proj", local_q + local_kv), kv_part),
        f"{src}o_proj.weight": TensorSpec((H, cfg.num_heads * D), _to(f"{dst}o_proj"),
                                          shard.part(1, shard.block(cfg.num_heads, D))),
    }
    if cfg.qk_norm:
        specs[f"{src}q_norm.weight"] = TensorSpec((D,), _to(f"{dst}q_norm.weight"))
        specs[f"{src}k_norm.weight"] = TensorSpec((D,), _to(f"{dst}k_norm.weight"))
    return specs


def _moe_specs(cfg: ModelConfig, src: str, dst: str, stored: Collection[str], shard: Shard) -> dict[str, TensorSpec]:
    """The router and the shared expert's gate are replicated; the shared expert is split along its
    intermediate width, and so is every routed expert, unless the rank holds whole experts (expert parallelism):
    then it reads its own experts' tensors (or rows of the fused stacks) whole and no other expert's."""
    H, E = cfg.hidden_size, cfg.num_experts
    I, S = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    Il, Sl = I // shard.size, S // shard.size
    in_proj, gate_up, down = f"{dst}in_proj", f"{dst}experts_gate_up", f"{dst}experts_down"
    shared_rows, shared_cols = shard.part(0, shard.block(S)), shard.part(1, shard.block(S))
    specs = {  # in_proj rows: router (E), shared-expert gate (1), shared gate (S), shared up (S)
        f"{src}gate.weight": TensorSpec((E, H), _to(in_proj, 0)),
        f"{src}shared_expert_gate.weight": TensorSpec((1, H), _to(in_proj, E)),
        f"{src}shared_expert.gate_proj.weight": TensorSpec((S, H), _to(in_proj, E + 1), shared_rows),
        f"{src}shared_expert.up_proj.weight": TensorSpec((S, H), _to(in_proj, E + 1 + Sl), shared_rows),
        f"{src}shared_expert.down_proj.weight": TensorSpec((H, S), _to(f"{dst}shared_down"), shared_cols),
    }
    local_experts = shard_config(cfg, shard).local_experts
    if local_experts is not None:
        return specs | _whole_expert_specs(src, gate_up, down, H, E, I, local_experts, stored)
    if f"{src}experts.gate_up_proj" in stored or f"{src}experts.down_proj" in stored:
        specs[f"{src}experts.gate_up_proj"] = TensorSpec(
            (E, 2 * I, H), _to(gate_up), shard.part(1, shard.block(I), shard.block(I, offset=I)))
        specs[f"{src}experts.down_proj"] = TensorSpec((E, H, I), _to(down), shard.part(2, shard.block(I)))
        return specs
    rows, cols = shard.part(0, shard.block(I)), shard.part(1, shard.block(I))
    for e in range(E):
        specs[f"{src}experts.{e}.gate_proj.weight"] = TensorSpec((I, H), _to(gate_up, 2 * Il * e), rows)
        specs[f"{src}experts.{e}.up_proj.weight"] = TensorSpec((I, H), _to(gate_up, 2 * Il * e + Il), rows)
        specs[f"{src}experts.{e}.down_proj.weight"] = TensorSpec((H, I), _to(down, H * e), cols)
    return specs


def _whole_expert_specs(src: str, gate_up: str, down: str, H: int, E: int, I: int, local: tuple[int, int],
                        stored: Collection[str]) -> dict[str, TensorSpec]:
    """An expert-parallel rank's routed experts `local` = (first, count), each whole: rows first .. of the fused
    stacks, or those experts' own tensors."""
    first, count = local
    if f"{src}experts.gate_up_proj" in stored or f"{src}experts.down_proj" in stored:
        return {f"{src}experts.gate_up_proj": TensorSpec((E, 2 * I, H), _to(gate_up), (0, ((first, count),))),
                f"{src}experts.down_proj": TensorSpec((E, H, I), _to(down), (0, ((first, count),)))}
    specs = {}
    for e in range(first, first + count):
        specs[f"{src}experts.{e}.gate_proj.weight"] = TensorSpec((I, H), _to(gate_up, 2 * I * (e - first)))
        specs[f"{src}experts.{e}.up_proj.weight"] = TensorSpec((I, H), _to(gate_up, 2 * I * (e - first) + I))
        specs[f"{src}experts.{e}.down_proj.weight"] = TensorSpec((H, I), _to(down, H * (e - first)))
    return specs


def _gdn_specs(cfg: ModelConfig, src: str, dst: str, shard: Shard) -> dict[str, TensorSpec]:
    """Key and value heads are split across ranks: a rank reads its heads' q, k and v rows of the fused qkv
    projection and conv (three ranges, which land in the rank's own [q | k | v] order), its heads' z, b, a rows,
    decays and biases, and its value heads' columns of out_proj. The gated norm's weight is per channel of a
    head, so replicated."""
    H, hk, hv = cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, kd = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.gdn_key_dim
    conv, vdim = cfg.gdn_conv_dim, cfg.gdn_value_dim
    local = shard_config(cfg, shard)
    lconv, lvdim, lhv = local.gdn_conv_dim, local.gdn_value_dim, local.linear_num_value_heads
    in_proj = f"{dst}in_proj"
    qkv = (shard.block(hk, dk), shard.block(hk, dk, kd), shard.block(hv, dv, 2 * kd))
    heads = shard.part(0, shard.block(hv))
    specs = {
        f"{src}conv1d.weight": TensorSpec(
            (conv, 1, cfg.linear_conv_kernel_dim), lambda t: [(f"{dst}conv_weight", 0, t.squeeze(1))],
            shard.part(0, *qkv)),
        f"{src}A_log": TensorSpec((hv,), _to(f"{dst}A_log"), heads),
        f"{src}dt_bias": TensorSpec((hv,), _to(f"{dst}dt_bias"), heads),
        f"{src}norm.weight": TensorSpec((cfg.linear_value_head_dim,), _to(f"{dst}norm_weight")),
        f"{src}out_proj.weight": TensorSpec((H, vdim), _to(f"{dst}out_proj"), shard.part(1, shard.block(hv, dv))),
    }
    if cfg.fused_gdn_projections:  # grouped per key head: a rank's key heads are one block of rows
        group = 2 * dk + 2 * (hv // hk) * dv
        specs[f"{src}in_proj_qkvz.weight"] = TensorSpec(
            (conv + vdim, H), lambda t: _split_qkvz(local, in_proj, t), shard.part(0, shard.block(hk, group)))
        specs[f"{src}in_proj_ba.weight"] = TensorSpec(
            (2 * hv, H), lambda t: _split_ba(local, in_proj, t), shard.part(0, shard.block(hk, 2 * (hv // hk))))
    else:
        specs[f"{src}in_proj_qkv.weight"] = TensorSpec((conv, H), _to(in_proj, 0), shard.part(0, *qkv))
        specs[f"{src}in_proj_z.weight"] = TensorSpec((vdim, H), _to(in_proj, lconv), shard.part(0, shard.block(hv, dv)))
        specs[f"{src}in_proj_b.weight"] = TensorSpec((hv, H), _to(in_proj, lconv + lvdim), heads)
        specs[f"{src}in_proj_a.weight"] = TensorSpec((hv, H), _to(in_proj, lconv + lvdim + lhv), heads)
    return specs


def _split_qkvz(cfg: ModelConfig, param: str, t: torch.Tensor) -> list[Piece]:
    """Qwen3-Next rows are grouped per key head: [q (dk), k (dk), v (r*dv), z (r*dv)] x HK."""
    hk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = cfg.linear_num_value_heads // hk
    grouped = t.view(hk, 2 * dk + 2 * r * dv, -1)
    q, k, v, z = grouped.split([dk, dk, r * dv, r * dv], dim=1)
    kd, vd = cfg.gdn_key_dim, cfg.gdn_value_dim
    flat = lambda x: x.reshape(-1, t.shape[-1])  # noqa: E731
    return [(param, 0, flat(q)), (param, kd, flat(k)), (param, 2 * kd, flat(v)), (param, 2 * kd + vd, flat(z))]


def _split_ba(cfg: ModelConfig, param: str, t: torch.Tensor) -> list[Piece]:
    """Qwen3-Next rows are grouped per key head: [b (r), a (r)] x HK."""
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    b, a = t.view(hk, 2 * (hv // hk), -1).split([hv // hk, hv // hk], dim=1)
    base = cfg.gdn_conv_dim + cfg.gdn_value_dim
    return [(param, base, b.reshape(hv, -1)), (param, base + hv, a.reshape(hv, -1))]
