"""Target-model configuration parsed from a Hugging Face `config.json` (or the dict a GGUF file yields).

One dataclass describes every supported target: dense attention models (llama, qwen3) and hybrid
Gated-DeltaNet models (qwen3_5 and its mixture-of-experts sibling qwen3_5_moe, each as a text config or the
vision-language wrapper; qwen3_next with dense or sparse feed-forward layers). The per-architecture differences
the forward pass needs (norm style, output gate, q/k norm, which layers are mixtures of experts) are plain fields
here; weight-name quirks live in `loading/weight_map.py`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from dflash_tfm.errors import CheckpointError
from dflash_tfm.rope_parameters import RopeParameters

SUPPORTED_ARCHITECTURES = ("llama", "qwen3", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"

# transformers 5's config-class defaults for the optional fields read here (None: derived as transformers derives
# it, head_dim = hidden / heads and num_key_value_heads = heads). Qwen3's head_dim and KV heads are fixed numbers
# in its class, and the hybrids rotate a quarter of the head dim unless the config says otherwise.
CLASS_DEFAULTS = {
    "llama": dict(head_dim=None, num_key_value_heads=None, max_position_embeddings=2048, partial_rotary_factor=1.0),
    "qwen3": dict(head_dim=128, num_key_value_heads=32, max_position_embeddings=32768, partial_rotary_factor=1.0),
    "qwen3_5": dict(head_dim=256, num_key_value_heads=4, max_position_embeddings=32768, partial_rotary_factor=0.25),
    "qwen3_5_moe": dict(head_dim=256, num_key_value_heads=2, max_position_embeddings=32768,
                        partial_rotary_factor=0.25),
    "qwen3_next": dict(head_dim=256, num_key_value_heads=2, max_position_embeddings=32768, partial_rotary_factor=0.25),
}
GDN_DEFAULTS = dict(linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                    linear_value_head_dim=128, linear_conv_kernel_dim=4)


@dataclass
class ModelConfig:
    """Everything the target model's forward pass and caches need to know."""

    model_type: str  # normalised: "llama" | "qwen3" | "qwen3_5" | "qwen3_5_moe" | "qwen3_next"
    hidden_size: int
    num_layers: int
    vocab_size: int
    intermediate_size: int  # the dense MLP's width (0 when every layer is a mixture of experts)
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    # attention layers
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RopeParameters
    attn_output_gate: bool = False  # q_proj emits [query | gate] per head (Qwen3.5 / Qwen3-Next)
    qk_norm: bool = False
    attention_bias: bool = False
    norm_plus_one: bool = False  # decoder RMSNorms scale by (1 + w) instead of w
    # Gated DeltaNet layers
    layer_types: list[str] = field(default_factory=list)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    # mixture-of-experts feed-forward: the layers in `moe_layers` replace the dense SwiGLU by a routed block
    moe_layers: list[int] = field(default_factory=list)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # one routed expert's SwiGLU width
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k router probabilities to sum to 1
    # expert parallelism: (first, count) of the routed experts one rank holds whole; None: every expert (sliced
    # by width across tensor-parallel ranks, if any). Set by `parallel.sharding.shard_config`, never by a checkpoint.
    local_experts: tuple[int, int] | None = None
    # checkpoint layout
    weight_prefix: str = "model."  # where decoder weights live ("model.language_model." for the VL wrapper)
    fused_gdn_projections: bool = False  # Qwen3-Next in_proj_qkvz / in_proj_ba
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None

    @property
    def is_hybrid(self) -> bool:
        return LINEAR_ATTENTION in self.layer_types

    @property
    def active_ffn_width(self) -> int:
        """The feed-forward width a token passes through: the dense MLP's when the target has one, else its k routed
        experts' plus the shared expert's. A dense drafter for this target takes it as its own FFN width."""
        if self.intermediate_size:
            return self.intermediate_size
        return self.num_experts_per_tok * self.moe_intermediate_size + self.shared_expert_intermediate_size

    @property
    def rope_theta(self) -> float:
        return self.rope.theta

    @property
    def partial_rotary_factor(self) -> float:
        return self.rope.partial_rotary_factor

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def gdn_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def gdn_conv_dim(self) -> int:
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        """Parse a HF config dict; raises CheckpointError for unsupported or inconsistent configs."""
        model_type = raw.get("model_type")
        prefix = "model."
        if model_type in ("qwen3_5", "qwen3_5_moe") or "text_config" in raw:
            # Vision-language wrapper: the text model's fields live under text_config.
            text = dict(raw.get("text_config") or raw)
            prefix = "model.language_model." if "text_config" in raw else "model."
            moe = model_type == "qwen3_5_moe" or text.get("model_type") == "qwen3_5_moe_text"
            return cls._hybrid(text, "qwen3_5_moe" if moe else "qwen3_5", prefix, raw)
        if model_type in ("qwen3_5_text", "qwen3_5_moe_text"):
            return cls._hybrid(raw, model_type.removesuffix("_text"), prefix, raw)
        if model_type == "qwen3_next":
            return cls._hybrid(raw, "qwen3_next", prefix, raw)
        if model_type in ("llama", "qwen3"):
            return cls._dense(raw, model_type)
        raise CheckpointError(
            f"unsupported architecture model_type={model_type!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    @staticmethod
    def _common(raw: dict, model_type: str) -> dict:
        """The fields every architecture reads; optional ones take transformers' default for `model_type`."""
        defaults = CLASS_DEFAULTS[model_type]
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            kv_heads = raw["num_key_value_heads"] if "num_key_value_heads" in raw else defaults["num_key_value_heads"]
            head_dim = raw["head_dim"] if "head_dim" in raw else defaults["head_dim"]
            max_positions = int(raw.get("max_position_embeddings") or defaults["max_position_embeddings"])
            fields = dict(
                hidden_size=hidden,
                num_layers=int(raw["num_hidden_layers"]),
                vocab_size=int(raw["vocab_size"]),
                intermediate_size=int(raw.get("intermediate_size") or 0),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=max_positions,
                num_heads=heads,
                num_kv_heads=int(kv_heads or heads),
                head_dim=int(head_dim or hidden // heads),
                attention_bias=bool(raw.get("attention_bias", False)),
                rope=RopeParameters.from_config(raw, max_positions, defaults["partial_rotary_factor"]),
            )
        except KeyError as e:
            raise CheckpointError(f"config is missing required field {e.args[0]!r}") from None
        if fields["attention_bias"]:
            raise CheckpointError("attention_bias=True checkpoints are not supported yet")
        fields["eos_token_ids"] = _eos_ids(raw)
        fields["bos_token_id"] = raw.get("bos_token_id")
        return fields

    @classmethod
    def _dense(cls, raw: dict, model_type: str) -> "ModelConfig":
        fields = cls._common(raw, model_type)
        _require_dense_width(fields, moe_layers=[])
        return cls(
            model_type=model_type,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qk_norm=model_type == "qwen3",
            layer_types=[FULL_ATTENTION] * fields["num_layers"],
            **fields,
        )

    @classmethod
    def _hybrid(cls, text: dict, model_type: str, prefix: str, outer: dict) -> "ModelConfig":
        fields = cls._common(text, model_type)
        n = fields["num_layers"]
        layer_types = text.get("layer_types")
        if not layer_types:
            interval = int(text.get("full_attention_interval", 4))
            layer_types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(n)]
        if len(layer_types) != n:
            raise CheckpointError(f"layer_types has {len(layer_types)} entries but num_hidden_layers is {n}")
        unknown = set(layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION}
        if unknown:
            raise CheckpointError(f"unknown layer types {sorted(unknown)}")
        moe = _moe_fields(text, model_type, n)
        _require_dense_width(fields, moe.get("moe_layers", []))
        tie = outer.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        fields["eos_token_ids"] = _eos_ids(text, outer)
        gdn = {k: int(text.get(k, GDN_DEFAULTS[k])) for k in GDN_DEFAULTS}
        hk, hv = gdn["linear_num_key_heads"], gdn["linear_num_value_heads"]
        if hv % hk:
            raise CheckpointError(f"linear_num_value_heads ({hv}) must be a multiple of linear_num_key_heads ({hk})")
        return cls(
            model_type=model_type,
            tie_word_embeddings=bool(tie),
            attn_output_gate=bool(text.get("attn_output_gate", True)),
            qk_norm=True,
            norm_plus_one=True,
            layer_types=list(layer_types),
            weight_prefix=prefix,
            fused_gdn_projections=model_type == "qwen3_next",
            **gdn,
            **moe,
            **fields,
        )


def _moe_fields(text: dict, model_type: str, num_layers: int) -> dict:
    """The mixture-of-experts fields of a hybrid text config, as transformers builds the layers: Qwen3.5-MoE makes
    every layer sparse and always renormalises the top-k probabilities (its router reads no `norm_topk_prob`);
    Qwen3-Next makes layer i sparse when `num_experts` > 0, i is not in `mlp_only_layers` and
    (i + 1) % `decoder_sparse_step` == 0, and renormalises as `norm_topk_prob` says (default true)."""
    if model_type == "qwen3_5_moe":
        sparse, normalise = list(range(num_layers)), True
    elif model_type == "qwen3_next" and int(text.get("num_experts") or 0) > 0:
        step = int(text.get("decoder_sparse_step") or 1)
        dense = set(text.get("mlp_only_layers") or [])
        sparse = [i for i in range(num_layers) if i not in dense and (i + 1) % step == 0]
        normalise = bool(text.get("norm_topk_prob", True))
    else:
        return {}
    if not sparse:
        return {}
    try:
        fields = dict(
            moe_layers=sparse,
            num_experts=int(text["num_experts"]),
            num_experts_per_tok=int(text["num_experts_per_tok"]),
            moe_intermediate_size=int(text["moe_intermediate_size"]),
            shared_expert_intermediate_size=int(text["shared_expert_intermediate_size"]),
            norm_topk_prob=normalise,
        )
    except KeyError as e:
        raise CheckpointError(f"mixture-of-experts config is missing required field {e.args[0]!r}") from None
    if not 0 < fields["num_experts_per_tok"] <= fields["num_experts"]:
        raise CheckpointError(f"num_experts_per_tok ({fields['num_experts_per_tok']}) must be in "
                              f"[1, num_experts = {fields['num_experts']}]")
    return fields


def _require_dense_width(fields: dict, moe_layers: list[int]) -> None:
    """A dense MLP layer needs `intermediate_size`; a target whose every layer is a mixture of experts has none."""
    if len(moe_layers) < fields["num_layers"] and fields["intermediate_size"] <= 0:
        raise CheckpointError("config is missing required field 'intermediate_size'")


def _eos_ids(*configs: dict) -> list[int]:
    """Union of eos ids from config.json and generation_config.json (either may hold an int or a list)."""
    ids: list[int] = []
    for cfg in configs:
        for key in ("eos_token_id", "_generation_eos_token_id"):
            value = cfg.get(key)
            for t in [] if value is None else ([value] if isinstance(value, int) else value):
                if int(t) not in ids:
                    ids.append(int(t))
    return ids


def load_config_file(model_dir: Path) -> dict:
    """Read config.json from a HF model directory with clear errors."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in model directory {model_dir}")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except json.JSONDecodeError:
            eos = None
        if eos is not None:
            raw.setdefault("_generation_eos_token_id", eos)
    return raw
