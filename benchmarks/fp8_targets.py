"""Random-weight targets for the timing scripts, optionally with every projection held in FP8 (`--quantization
fp8`), so AR decode, verify and speculative steps can be timed FP8 against BF16 at the published shapes without
a checkpoint; and the bytes one decode step of such a target must read (its bandwidth floor)."""
from __future__ import annotations

import torch

from dflash_tfm.config import ModelConfig
from dflash_tfm.kernels.fp8.block_quant import expand_block_scales, quantize_blocks
from dflash_tfm.layers.fp8_weight import Fp8Weight
from dflash_tfm.layers.linear import deferred_projection_weights
from dflash_tfm.layers.moe import SparseMoE
from dflash_tfm.loading.fp8_layout import allocate_projections
from dflash_tfm.loading.loader import build_model
from dflash_tfm.models.decoder import CausalLM
from dflash_tfm.models.presets import QWEN3_5_35B_A3B, QWEN3_6_27B, QWEN3_6_27B_DFLASH, QWEN3_6_35B_A3B_DFLASH
from dflash_tfm.models.random_init import init_random_

# --target name -> (target config, its published drafter's config)
TARGETS = {"qwen3.6-27b": (QWEN3_6_27B, QWEN3_6_27B_DFLASH), "qwen3.5-35b-a3b": (QWEN3_5_35B_A3B, QWEN3_6_35B_A3B_DFLASH)}


@torch.no_grad()
def random_target(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, max_positions: int,
                  quantization: str | None = None, seed: int = 0) -> CausalLM:
    """`init_random_` weights; with quantization "fp8" each projection is then quantized in 128 x 128 blocks and
    held as an `Fp8Weight` (one projection at a time, so the peak is the BF16 model plus one projection)."""
    with deferred_projection_weights():
        model = build_model(cfg, device, dtype, max_positions)
    projections = [name for name, p in model.named_parameters() if p.is_meta]
    allocate_projections(model, {}, device, dtype)
    init_random_(model, seed)
    if quantization is None:
        return model
    if quantization != "fp8":
        raise ValueError(f"--quantization {quantization!r}: only fp8")
    for name in projections:
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        weight = getattr(owner, attr)
        q, scales = quantize_blocks(weight)
        holder = Fp8Weight(tuple(weight.shape), device=device)
        holder.weight.copy_(q)
        holder.scale.copy_(expand_block_scales(scales, weight.shape[-2]))
        del owner._parameters[attr], weight
        setattr(owner, attr, holder)
    return model


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of every parameter and FP8 weight buffer (weight, scales, exact rows) of ``module``."""
    fp8 = [t for m in module.modules() if isinstance(m, Fp8Weight) for t in m.buffers()]
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *fp8])


def bytes_per_token(model: CausalLM) -> int:
    """The weight bytes one decode step reads: all of them, less the embedding table but the token's row (unless
    it is also the lm_head) and less the routed experts a token does not use (top-k of E per MoE layer)."""
    total = weight_bytes(model)
    if model.lm_head is not None:
        table = model.embed_tokens
        total -= (table.shape[0] - 1) * table.shape[1] * table.element_size()
    for moe in (m for m in model.modules() if isinstance(m, SparseMoE)):
        experts = sum(weight_bytes(w) if isinstance(w, Fp8Weight) else w.numel() * w.element_size()
                      for w in (moe.experts_gate_up, moe.experts_down))
        total -= experts * (moe.num_experts - moe.top_k) // moe.num_experts
    return total
