"""Random DFlash drafter checkpoints in the exact published z-lab layout, for tests and timing without weights.

The directory holds `config.json` (architectures ["DFlashDraftModel"], model_type "qwen3", `dflash_config`
with mask id and taps, top-level `block_size`) and one `model.safetensors` with the unprefixed tensor names,
so it goes through the same loader a downloaded drafter does.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from dflash_tfm.config import ModelConfig
from dflash_tfm.spec.dflash import checkpoint_tensors
from dflash_tfm.spec.dflash_config import DFlashConfig, drafter_config_dict


def write_random_dflash_checkpoint(
    path: str | Path,
    target_cfg: ModelConfig,
    num_layers: int = 1,
    block_size: int = 16,
    layer_types: list[str] | None = None,
    sliding_window: int | None = None,
    mask_token_id: int | None = None,
    target_layer_ids: list[int] | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a random drafter for `target_cfg` into directory `path` (created) and return it.

    Attention shape, FFN width and RoPE base follow the target; taps default to the reference's rule, the
    mask id to the last id of the target vocabulary. Matrices ~ N(0, 1/fan_in); norm weights ~ 1 + N(0, 0.1)
    (away from the identity, so a missed norm shows up in tests).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    raw = drafter_config_dict(
        target_cfg, num_layers=num_layers, block_size=block_size,
        mask_token_id=target_cfg.vocab_size - 1 if mask_token_id is None else mask_token_id,
        target_layer_ids=target_layer_ids, layer_types=layer_types, sliding_window=sliding_window, dtype=dtype,
    )
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, spec in checkpoint_tensors(DFlashConfig.from_dict(raw)).items():
        if len(spec.shape) == 1:
            t = 1.0 + 0.1 * torch.randn(spec.shape, generator=gen)
        else:
            t = torch.randn(spec.shape, generator=gen) / math.sqrt(spec.shape[-1])
        tensors[name] = t.to(dtype).contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
