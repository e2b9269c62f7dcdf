"""Configuration of a DFlash block drafter (z-lab format), parsed from the drafter's `config.json`.

The drafter is a small Qwen3-style stack that reads the target's tap-layer outputs ("context features") and
predicts a block of `block_size` tokens in one pass. Fields may sit at the top level or under `dflash_config`
(`block_size`, `mask_token_id`, `target_layer_ids`); the latter wins, as in the reference implementation.
`check_fits` says, before any weight is read, whether the drafter can be attached to a given target.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_tfm.config import FULL_ATTENTION, ModelConfig
from dflash_tfm.errors import CheckpointError, CheckpointNotFoundError
from dflash_tfm.rope_parameters import RopeParameters

SLIDING_ATTENTION = "sliding_attention"
DFLASH_ARCHITECTURE = "DFlashDraftModel"
# transformers' Qwen3Config defaults the reference drafter class reads when a field is absent.
DEFAULT_MAX_POSITIONS = 32768
DEFAULT_MAX_WINDOW_LAYERS = 28
DEFAULT_HEAD_DIM, DEFAULT_KV_HEADS = 128, 32


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Taps when the config names none: one draft layer -> the middle target layer; else `n` ids spread
    evenly over [1, L-3] (Python `round`, as the reference does)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass
class DFlashConfig:
    """Everything the drafter's forward pass, cache and loader need.

    `causal_sliding_in_block`: sliding-window layers attend causally inside the block (True) or bidirectionally
    (False). Full-attention layers are always bidirectional inside the block. Unless the caller forces it,
    the config's `is_causal` decides, and without one it is True: the current z-lab reference
    (`is_causal = layer_type == "sliding_attention"`) and SGLang both run sliding layers causally.

    `sliding_window` follows transformers' Qwen3Config, the class the reference drafter is built on: it is the
    config's `sliding_window` only when `use_sliding_window` is true (the class default is false), so a drafter
    whose config leaves the window off runs its `sliding_attention` layers over every key (still causal inside
    the block as above). Without `layer_types`, layers from `max_window_layers` on slide when the window is on.

    The reference's optional output fields (z-lab `DFlashDraftModel.compute_logits` and `_raw_input_embeddings`;
    read from `dflash_config` first, then the top level): the block's token embeddings are multiplied by
    `input_embedding_scale`, the logits by `output_multiplier`, then soft-capped as
    `cap · tanh(logits / cap)` when `final_logit_softcapping` is set and positive.
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeParameters
    layer_types: list[str]
    sliding_window: int | None  # None when no layer slides
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int | None = None
    causal_sliding_in_block: bool = False
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def rope_theta(self) -> float:
        return self.rope.theta

    @property
    def shapes_logits(self) -> bool:
        """Whether the drafter rescales its inputs or logits (the reference's optional output fields)."""
        return (self.input_embedding_scale != 1.0 or self.output_multiplier != 1.0
                or self.final_logit_softcapping is not None)

    @classmethod
    def from_dict(cls, raw: dict, causal_sliding_in_block: bool | None = None) -> "DFlashConfig":
        """Parse a drafter config dict; raises CheckpointError for other formats or inconsistent fields."""
        archs = raw.get("architectures") or [DFLASH_ARCHITECTURE]
        if DFLASH_ARCHITECTURE not in archs:
            raise CheckpointError(f"unsupported drafter architecture {archs}; supported: {DFLASH_ARCHITECTURE} (z-lab DFlash)")
        dflash = raw.get("dflash_config") or {}

        def pick(name: str, default: object = None) -> object:
            return dflash.get(name, raw.get(name, default))

        if raw.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"unsupported drafter hidden_act {raw['hidden_act']!r}; supported: silu")
        if raw.get("attention_bias", False):
            raise CheckpointError("drafters with attention_bias=True are not supported")
        try:
            hidden, heads, n = int(raw["hidden_size"]), int(raw["num_attention_heads"]), int(raw["num_hidden_layers"])
            intermediate = int(raw["intermediate_size"])
        except KeyError as e:
            raise CheckpointError(f"drafter config is missing required field {e.args[0]!r}") from None
        window = _sliding_window(raw)
        max_window_layers = int(raw.get("max_window_layers", DEFAULT_MAX_WINDOW_LAYERS))
        layer_types = list(raw.get("layer_types") or [
            SLIDING_ATTENTION if window is not None and i >= max_window_layers else FULL_ATTENTION for i in range(n)])
        if len(layer_types) != n:
            raise CheckpointError(f"drafter layer_types has {len(layer_types)} entries but num_hidden_layers is {n}")
        unknown = set(layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
        if unknown:
            raise CheckpointError(f"unknown drafter layer types {sorted(unknown)}")
        if SLIDING_ATTENTION not in layer_types:
            window = None
        num_target_layers = raw.get("num_target_layers")
        num_target_layers = None if num_target_layers is None else int(num_target_layers)
        taps = pick("target_layer_ids")
        if taps is None:
            if num_target_layers is None:
                raise CheckpointError("drafter config has neither dflash_config.target_layer_ids nor num_target_layers")
            taps = default_target_layer_ids(num_target_layers, n)
        mask_token_id = pick("mask_token_id")
        if mask_token_id is None:
            raise CheckpointError("drafter config has no mask_token_id (top level or in dflash_config)")
        block_size = int(pick("block_size", 16))
        if block_size < 2:
            raise CheckpointError(f"drafter block_size must be >= 2, got {block_size}")
        rope = RopeParameters.from_config(raw, int(raw.get("max_position_embeddings") or DEFAULT_MAX_POSITIONS),
                                          what="drafter")
        if rope.partial_rotary_factor != 1.0:
            raise CheckpointError(f"drafter partial_rotary_factor {rope.partial_rotary_factor}: the reference drafter "
                                  "rotates the whole head dim")
        softcap = pick("final_logit_softcapping")
        return cls(
            hidden_size=hidden,
            num_layers=n,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads", DEFAULT_KV_HEADS) or heads),
            head_dim=int(raw.get("head_dim", DEFAULT_HEAD_DIM) or hidden // heads),
            intermediate_size=intermediate,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=rope,
            layer_types=layer_types,
            sliding_window=window,
            block_size=block_size,
            mask_token_id=int(mask_token_id),
            target_layer_ids=[int(t) for t in taps],
            num_target_layers=num_target_layers,
            causal_sliding_in_block=bool(raw.get("is_causal", True)) if causal_sliding_in_block is None
            else causal_sliding_in_block,
            input_embedding_scale=float(pick("input_embedding_scale", 1.0)),
            output_multiplier=float(pick("output_multiplier", 1.0)),
            final_logit_softcapping=float(softcap) if softcap is not None and float(softcap) > 0 else None,
        )

    def check_fits(self, target: ModelConfig, fc_in_features: int | None = None) -> None:
        """Raise one CheckpointError listing every reason this drafter cannot run on `target`.

        `fc_in_features`: the checkpoint's `fc.weight.shape[1]`, which must be K taps x target hidden.
        """
        n, problems = target.num_layers, []
        bad = [t for t in self.target_layer_ids if not 0 <= t < n]
        if bad:
            problems.append(
                f"target_layer_ids {self.target_layer_ids} contain {bad}, but the target has {n} layers (valid ids 0..{n - 1})"
            )
        if any(a >= b for a, b in zip(self.target_layer_ids, self.target_layer_ids[1:])):
            problems.append(
                f"target_layer_ids {self.target_layer_ids} must be strictly increasing (the target returns taps in layer order)"
            )
        if self.num_target_layers is not None and self.num_target_layers != n:
            problems.append(f"the drafter was trained on a {self.num_target_layers}-layer target; this target has {n} layers")
        if self.hidden_size != target.hidden_size:
            problems.append(
                f"drafter hidden_size {self.hidden_size} != target hidden_size {target.hidden_size} (the drafter reads "
                "the target's embed_tokens and lm_head, so they must be equal)"
            )
        expected_fc = self.num_taps * target.hidden_size
        if fc_in_features is not None and fc_in_features != expected_fc:
            problems.append(
                f"fc.weight takes {fc_in_features} input features, but {self.num_taps} taps x target hidden "
                f"{target.hidden_size} = {expected_fc}"
            )
        if not 0 <= self.mask_token_id < target.vocab_size:
            problems.append(f"mask_token_id {self.mask_token_id} is outside the target vocabulary (size {target.vocab_size})")
        if problems:
            raise CheckpointError("DFlash drafter does not fit the target:\n  " + "\n  ".join(problems))


def _sliding_window(raw: dict) -> int | None:
    """The window of sliding layers as Qwen3Config sets it: the config's `sliding_window` when
    `use_sliding_window` is true, else none. A window switched on without a positive size is refused."""
    if not raw.get("use_sliding_window", False):
        return None
    window = raw.get("sliding_window")
    if window is None or int(window) <= 0:
        raise CheckpointError(f"drafter sets use_sliding_window but its sliding_window is {window!r}")
    return int(window)


def load_dflash_config(path: str | Path, causal_sliding_in_block: bool | None = None) -> DFlashConfig:
    """Read `config.json` of a local drafter directory, naming the missing directory or file."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise CheckpointNotFoundError(f"DFlash drafter directory not found: {p}")
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise CheckpointNotFoundError(f"no config.json in DFlash drafter directory {p}")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON: {e}") from None
    return DFlashConfig.from_dict(raw, causal_sliding_in_block)


def drafter_config_dict(
    target_cfg: ModelConfig,
    *,
    num_layers: int,
    block_size: int,
    mask_token_id: int,
    target_layer_ids: list[int] | None = None,
    layer_types: list[str] | None = None,
    sliding_window: int | None = None,
    causal_sliding_in_block: bool = True,
    dtype: torch.dtype = torch.bfloat16,
) -> dict:
    """The drafter's `config.json` (z-lab layout). Width follows the target (the drafter reads its embeddings
    and lm_head), as do heads, FFN width (a mixture-of-experts target's active width) and RoPE base; taps default to the reference rule
    (`default_target_layer_ids`). `is_causal` is written explicitly so inference runs sliding layers exactly
    as they were trained."""
    layer_types = list(layer_types or [FULL_ATTENTION] * num_layers)
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} drafter layers")
    # The reference rule repeats ids on targets with fewer than num_layers + 3 layers; taps must be distinct.
    taps = list(target_layer_ids) if target_layer_ids is not None else sorted(set(default_target_layer_ids(
        target_cfg.num_layers, num_layers)))
    sliding = SLIDING_ATTENTION in layer_types
    if sliding and not sliding_window:
        raise ValueError("sliding_attention layers need a sliding_window")
    return {
        "architectures": [DFLASH_ARCHITECTURE],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "hidden_size": target_cfg.hidden_size,
        "intermediate_size": target_cfg.active_ffn_width,
        "num_hidden_layers": num_layers,
        "num_attention_heads": target_cfg.num_heads,
        "num_key_value_heads": target_cfg.num_kv_heads,
        "head_dim": target_cfg.head_dim,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": target_cfg.rope_theta},
        "layer_types": layer_types,
        "sliding_window": sliding_window if sliding else None,
        "use_sliding_window": sliding,
        "is_causal": causal_sliding_in_block,
        "max_position_embeddings": target_cfg.max_position_embeddings,
        "vocab_size": target_cfg.vocab_size,
        "tie_word_embeddings": False,
        "num_target_layers": target_cfg.num_layers,
        "block_size": block_size,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": taps},
        "dtype": str(dtype).removeprefix("torch."),
    }
