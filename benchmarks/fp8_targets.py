"""Random-weight targets for the timing scripts, optionally with every projection held in FP8 (`--quantization
fp8`), so AR decode and verify steps can be timed FP8 against BF16 at the 27B shapes without a checkpoint."""
from __future__ import annotations

import torch

from dflash_tfm.config import ModelConfig
from dflash_tfm.kernels.fp8.block_quant import expand_block_scales, quantize_blocks
from dflash_tfm.layers.fp8_weight import Fp8Weight
from dflash_tfm.layers.linear import deferred_projection_weights
from dflash_tfm.loading.fp8_layout import allocate_projections
from dflash_tfm.loading.loader import build_model
from dflash_tfm.models.decoder import CausalLM
from dflash_tfm.models.random_init import init_random_


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
