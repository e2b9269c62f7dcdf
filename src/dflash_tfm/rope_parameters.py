"""RoPE parameters of a Hugging Face config (a target's or a drafter's) and the frequencies they define.

Read as transformers 5 reads them (`RotaryEmbeddingConfigMixin` in `configuration_utils` /
`modeling_rope_utils.py`): the dict is the legacy `rope_scaling` when the config has one, else
`rope_parameters`; `rope_theta` and `partial_rotary_factor` come from that dict, else the top level, else the
model class's default; `rope_type` (or the legacy `type`) defaults to "default"; YaRN and llama3 take
`original_max_position_embeddings` from the top level when it is there (Phi-3 style), else from the dict, else
`max_position_embeddings`.

The scaling types are those of transformers' `ROPE_INIT_FUNCTIONS`, computed the same way (same fp32 ops), so the
engine's cos/sin tables equal transformers' (`layers/rotary.py` multiplies both by the attention factor, as
transformers does):

* `default` (and `mrope`, whose three position streams coincide for text): `1 / theta^(2i / d)`;
* `linear`: the default frequencies divided by `factor`;
* `dynamic` (NTK): equal to `default` up to `max_position_embeddings`, and only past it does transformers
  recompute frequencies from the length of the current forward call. The engine's tables serve at most
  `max_position_embeddings` positions there (`check_table_length`), so `dynamic` is `default`;
* `yarn`: per-frequency blend of interpolation (`/ factor`) and extrapolation over the ramp `beta_fast` ..
  `beta_slow` (defaults 32 and 1, `truncate` default true), and the attention factor `attention_factor`, else
  `0.1 · mscale · ln(factor) + 1` over the same with `mscale_all_dim` when both are set, else
  `0.1 · ln(factor) + 1` (1 when factor ≤ 1);
* `llama3`: low frequencies divided by `factor`, high ones kept, a smooth blend between.

Refused, naming the type: `longrope` (transformers switches every position from short to long factors once the
current call runs past `original_max_position_embeddings`, which fixed per-position tables cannot express) and
`proportional` (Gemma 4's, whose frequency layout covers the whole head dim), and any other name.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dflash_tfm.errors import CheckpointError

SCALING_FIELDS = ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
                  "mscale", "mscale_all_dim", "low_freq_factor", "high_freq_factor")
SUPPORTED_TYPES = ("default", "mrope", "linear", "dynamic", "yarn", "llama3")
NEEDS_FACTOR = ("linear", "dynamic", "yarn", "llama3")


@dataclass(frozen=True)
class RopeParameters:
    """One model's RoPE: type, base, rotated fraction of the head dim, and the scaling fields its type reads."""

    rope_type: str = "default"
    theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 4096
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None

    @classmethod
    def from_config(cls, raw: dict, max_position_embeddings: int, default_partial_rotary_factor: float = 1.0,
                    default_theta: float = 10000.0, what: str = "model") -> "RopeParameters":
        """Parse the RoPE fields of a config dict; `what` names the model in errors ("drafter", ...)."""
        params = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
        rope_type = params.get("rope_type") or params.get("type") or "default"
        if rope_type not in SUPPORTED_TYPES:
            why = {"longrope": " (it switches every position's factors with the current sequence length, which "
                               "per-position tables cannot express)",
                   "proportional": " (Gemma 4's layout)"}.get(rope_type, "")
            raise CheckpointError(f"unsupported {what} rope_type {rope_type!r}{why}; supported: "
                                  f"{', '.join(SUPPORTED_TYPES)}")
        if rope_type in NEEDS_FACTOR and params.get("factor") is None:
            raise CheckpointError(f"{what} rope_type {rope_type!r} needs a 'factor'")
        if rope_type == "llama3" and (params.get("low_freq_factor") is None or params.get("high_freq_factor") is None):
            raise CheckpointError(f"{what} rope_type 'llama3' needs 'low_freq_factor' and 'high_freq_factor'")
        fields = {k: params[k] for k in SCALING_FIELDS if params.get(k) is not None}
        if rope_type in ("yarn", "llama3"):
            original = raw.get("original_max_position_embeddings") or fields.get("original_max_position_embeddings")
            fields["original_max_position_embeddings"] = int(original or max_position_embeddings)
        partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
        rope = cls(
            rope_type="default" if rope_type == "mrope" else rope_type,
            theta=float(params.get("rope_theta", raw.get("rope_theta", default_theta))),
            partial_rotary_factor=float(default_partial_rotary_factor if partial is None else partial),
            max_position_embeddings=int(max_position_embeddings),
            truncate=bool(params.get("truncate", True)),
            **{k: (int(v) if k == "original_max_position_embeddings" else float(v)) for k, v in fields.items()},
        )
        if rope.theta <= 0 or not 0 < rope.partial_rotary_factor <= 1 or (rope.factor is not None and rope.factor <= 0):
            raise CheckpointError(f"{what} RoPE needs rope_theta > 0, partial_rotary_factor in (0, 1] and factor > 0; "
                                  f"got {rope.theta}, {rope.partial_rotary_factor}, {rope.factor}")
        return rope

    def check_table_length(self, positions: int, what: str = "model") -> None:
        """Dynamic NTK scaling equals the default frequencies only up to max_position_embeddings (module docstring):
        a table longer than that is refused rather than silently different from transformers."""
        if self.rope_type == "dynamic" and positions > self.max_position_embeddings:
            raise ValueError(f"{what} uses dynamic RoPE scaling, which changes its frequencies past "
                             f"max_position_embeddings = {self.max_position_embeddings}; {positions} positions asked")

    def inverse_frequencies(self, rotary_dim: int) -> tuple[torch.Tensor, float]:
        """(inv_freq [rotary_dim / 2] fp32, attention factor) of this RoPE over `rotary_dim` rotated dims."""
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        if self.rope_type == "yarn":
            return self._yarn(rotary_dim)
        inv_freq = 1.0 / (self.theta ** exponents)
        if self.rope_type == "linear":
            inv_freq = inv_freq / self.factor
        elif self.rope_type == "llama3":
            inv_freq = self._llama3(inv_freq)
        return inv_freq, 1.0

    def _yarn(self, dim: int) -> tuple[torch.Tensor, float]:
        """transformers' `_compute_yarn_parameters`, operation for operation."""
        factor, original = self.factor, self.original_max_position_embeddings

        def get_mscale(scale: float, mscale: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

        attention = self.attention_factor
        if attention is None:
            if self.mscale and self.mscale_all_dim:
                attention = float(get_mscale(factor, self.mscale) / get_mscale(factor, self.mscale_all_dim))
            else:
                attention = get_mscale(factor)
        beta_fast, beta_slow = self.beta_fast or 32, self.beta_slow or 1

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(self.theta))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # as transformers: no singular ramp
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        pos_freqs = self.theta ** (torch.arange(0, dim, 2).float() / dim)
        extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
        extrapolation_factor = 1 - ramp
        inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
        return inv_freq, attention

    def _llama3(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """transformers' `_compute_llama3_parameters` applied to the default frequencies."""
        factor, low_factor, high_factor = self.factor, self.low_freq_factor, self.high_freq_factor
        old_context = self.original_max_position_embeddings
        low_wavelen, high_wavelen = old_context / low_factor, old_context / high_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low_factor) / (high_factor - low_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
