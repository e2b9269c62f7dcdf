"""Which checkpoint tensors a target needs, their shapes, and where each lands in our fused parameters.

Format quirks live here, not in the forward pass: q/k/v and gate/up are concatenated into one matrix,
the four GDN input projections into one `in_proj`, Qwen3-Next's head-grouped `in_proj_qkvz` / `in_proj_ba`
are regrouped into the Qwen3.5 order, and the conv weight loses its singleton dim. A mixture-of-experts layer's
router, shared-expert gate and shared gate / up go into one `in_proj`, and its experts into two stacks, from
either layout they are stored in: fused (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`
[E, H, I], as transformers holds them) or one tensor per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`,
as transformers saves them and Qwen3-Next was released).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Collection

import torch

from dflash_tfm.config import FULL_ATTENTION, ModelConfig

# (our parameter name, first row in it, the rows to write there); a parameter with more than two dims counts
# rows over all but its last dim ([E, 2I, H]: E · 2I rows of H), as do the rows written.
Piece = tuple[str, int, torch.Tensor]

# Checkpoint entries that are not part of the text decoder: vision tower, multi-token-prediction head,
# and rotary caches some older checkpoints saved.
IGNORED = re.compile(r"^(model\.visual\.|visual\.|mtp\.|model\.mtp\.)|rotary_emb\.inv_freq$")


@dataclass(frozen=True)
class TensorSpec:
    """One expected checkpoint tensor: its shape and how to split it into our parameters."""

    shape: tuple[int, ...]
    assign: Callable[[torch.Tensor], list[Piece]]


def _to(param: str, row: int = 0) -> Callable[[torch.Tensor], list[Piece]]:
    return lambda t: [(param, row, t)]


def expected_tensors(cfg: ModelConfig, stored: Collection[str] = ()) -> dict[str, TensorSpec]:
    """Map of checkpoint tensor name -> spec for every tensor the model needs. `stored` (the checkpoint's tensor
    names) picks each mixture-of-experts layer's expert layout: fused when it holds that layer's fused tensors,
    else one tensor per expert."""
    H, p = cfg.hidden_size, cfg.weight_prefix
    specs: dict[str, TensorSpec] = {
        f"{p}embed_tokens.weight": TensorSpec((cfg.vocab_size, H), _to("embed_tokens")),
        f"{p}norm.weight": TensorSpec((H,), _to("norm.weight")),
    }
    if not cfg.tie_word_embeddings:
        specs["lm_head.weight"] = TensorSpec((cfg.vocab_size, H), _to("lm_head"))
    for i, layer_type in enumerate(cfg.layer_types):
        src, dst = f"{p}layers.{i}.", f"layers.{i}."
        specs[f"{src}input_layernorm.weight"] = TensorSpec((H,), _to(f"{dst}input_norm.weight"))
        specs[f"{src}post_attention_layernorm.weight"] = TensorSpec((H,), _to(f"{dst}post_norm.weight"))
        if i in cfg.moe_layers:
            specs.update(_moe_specs(cfg, src + "mlp.", dst + "mlp.", stored))
        else:
            I = cfg.intermediate_size
            specs[f"{src}mlp.gate_proj.weight"] = TensorSpec((I, H), _to(f"{dst}mlp.gate_up", 0))
            specs[f"{src}mlp.up_proj.weight"] = TensorSpec((I, H), _to(f"{dst}mlp.gate_up", I))
            specs[f"{src}mlp.down_proj.weight"] = TensorSpec((H, I), _to(f"{dst}mlp.down"))
        if layer_type == FULL_ATTENTION:
            specs.update(_attention_specs(cfg, src + "self_attn.", dst + "mixer."))
        else:
            specs.update(_gdn_specs(cfg, src + "linear_attn.", dst + "mixer."))
    return specs


def _attention_specs(cfg: ModelConfig, src: str, dst: str) -> dict[str, TensorSpec]:
    H, D = cfg.hidden_size, cfg.head_dim
    q_rows = cfg.num_heads * D * (2 if cfg.attn_output_gate else 1)
    kv_rows = cfg.num_kv_heads * D
    specs = {
        f"{src}q_proj.weight": TensorSpec((q_rows, H), _to(f"{dst}qkv_proj", 0)),
        f"{src}k_proj.weight": TensorSpec((kv_rows, H), _to(f"{dst}qkv_proj", q_rows)),
        f"{src}v_proj.weight": TensorSpec((kv_rows, H), _to(f"{dst}qkv_proj", q_rows + kv_rows)),
        f"{src}o_proj.weight": TensorSpec((H, cfg.num_heads * D), _to(f"{dst}o_proj")),
    }
    if cfg.qk_norm:
        specs[f"{src}q_norm.weight"] = TensorSpec((D,), _to(f"{dst}q_norm.weight"))
        specs[f"{src}k_norm.weight"] = TensorSpec((D,), _to(f"{dst}k_norm.weight"))
    return specs


def _moe_specs(cfg: ModelConfig, src: str, dst: str, stored: Collection[str]) -> dict[str, TensorSpec]:
    H, E = cfg.hidden_size, cfg.num_experts
    I, S = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    in_proj, gate_up, down = f"{dst}in_proj", f"{dst}experts_gate_up", f"{dst}experts_down"
    specs = {  # in_proj rows: router (E), shared-expert gate (1), shared gate (S), shared up (S)
        f"{src}gate.weight": TensorSpec((E, H), _to(in_proj, 0)),
        f"{src}shared_expert_gate.weight": TensorSpec((1, H), _to(in_proj, E)),
        f"{src}shared_expert.gate_proj.weight": TensorSpec((S, H), _to(in_proj, E + 1)),
        f"{src}shared_expert.up_proj.weight": TensorSpec((S, H), _to(in_proj, E + 1 + S)),
        f"{src}shared_expert.down_proj.weight": TensorSpec((H, S), _to(f"{dst}shared_down")),
    }
    if f"{src}experts.gate_up_proj" in stored or f"{src}experts.down_proj" in stored:
        specs[f"{src}experts.gate_up_proj"] = TensorSpec((E, 2 * I, H), _to(gate_up))
        specs[f"{src}experts.down_proj"] = TensorSpec((E, H, I), _to(down))
        return specs
    for e in range(E):
        specs[f"{src}experts.{e}.gate_proj.weight"] = TensorSpec((I, H), _to(gate_up, 2 * I * e))
        specs[f"{src}experts.{e}.up_proj.weight"] = TensorSpec((I, H), _to(gate_up, 2 * I * e + I))
        specs[f"{src}experts.{e}.down_proj.weight"] = TensorSpec((H, I), _to(down, H * e))
    return specs


def _gdn_specs(cfg: ModelConfig, src: str, dst: str) -> dict[str, TensorSpec]:
    H, hv = cfg.hidden_size, cfg.linear_num_value_heads
    conv, vdim = cfg.gdn_conv_dim, cfg.gdn_value_dim
    in_proj = f"{dst}in_proj"
    specs = {
        f"{src}conv1d.weight": TensorSpec(
            (conv, 1, cfg.linear_conv_kernel_dim), lambda t: [(f"{dst}conv_weight", 0, t.squeeze(1))]
        ),
        f"{src}A_log": TensorSpec((hv,), _to(f"{dst}A_log")),
        f"{src}dt_bias": TensorSpec((hv,), _to(f"{dst}dt_bias")),
        f"{src}norm.weight": TensorSpec((cfg.linear_value_head_dim,), _to(f"{dst}norm_weight")),
        f"{src}out_proj.weight": TensorSpec((H, vdim), _to(f"{dst}out_proj")),
    }
    if cfg.fused_gdn_projections:
        specs[f"{src}in_proj_qkvz.weight"] = TensorSpec((conv + vdim, H), lambda t: _split_qkvz(cfg, in_proj, t))
        specs[f"{src}in_proj_ba.weight"] = TensorSpec((2 * hv, H), lambda t: _split_ba(cfg, in_proj, t))
    else:
        specs[f"{src}in_proj_qkv.weight"] = TensorSpec((conv, H), _to(in_proj, 0))
        specs[f"{src}in_proj_z.weight"] = TensorSpec((vdim, H), _to(in_proj, conv))
        specs[f"{src}in_proj_b.weight"] = TensorSpec((hv, H), _to(in_proj, conv + vdim))
        specs[f"{src}in_proj_a.weight"] = TensorSpec((hv, H), _to(in_proj, conv + vdim + hv))
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
