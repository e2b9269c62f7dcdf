"""Helpers of the loading tests: copy a saved checkpoint directory, edit its tensors, run the header check, write
an FP8 block-quantized copy."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dflash_tfm.config import ModelConfig
from dflash_tfm.kernels.fp8.block_quant import dequantize_rows, expand_block_scales, quantize_blocks
from dflash_tfm.loading.fp8_layout import KEPT_DENSE
from dflash_tfm.loading.loader import check_checkpoint, load_model, open_checkpoint
from dflash_tfm.loading.quantization import checkpoint_quantization

FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
NOT_QUANTIZED = re.compile(r"embed_tokens|lm_head|conv1d|visual|mtp")


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_weights(path: Path, edit) -> Path:
    """Apply `edit` (in place, on the name -> tensor dict) to the directory's model.safetensors."""
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")
    return path


def check(path: Path) -> None:
    """The loader's config + tensor-header check of the directory, without reading any tensor."""
    source, raw, _ = open_checkpoint(path)
    check_checkpoint(source, ModelConfig.from_dict(raw), checkpoint_quantization(raw))


def quantize_checkpoint(src: Path, dst: Path, dequantized: Path | None = None) -> Path:
    """Copy the HF directory `src` to `dst` in the FP8 block format of Qwen's releases: every projection matrix
    (not embeddings, lm_head, conv, norms, nor `KEPT_DENSE`) as float8_e4m3fn plus `weight_scale_inv`, and
    `quantization_config` in config.json (at the top level, also for the vision-language wrapper). With
    `dequantized`, also write there the plain fp32 checkpoint of the same values (the oracle)."""
    tensors = load_file(src / "model.safetensors")
    quantized, plain = {}, {}
    for name, t in tensors.items():
        if t.dim() >= 2 and name.endswith(("weight", "_proj")) and not NOT_QUANTIZED.search(name) \
                and not KEPT_DENSE.search(name):
            q, scale = quantize_blocks(t)
            quantized[name], quantized[name + "_scale_inv"] = q, scale
            plain[name] = dequantize_rows(q, expand_block_scales(scale, t.shape[-2]), t.dtype)
        else:
            quantized[name] = plain[name] = t
    for out, weights, fp8 in ((dst, quantized, True), (dequantized, plain, False)):
        if out is None:
            continue
        shutil.copytree(src, out)
        save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
        if fp8:
            raw = json.loads((out / "config.json").read_text())
            raw["quantization_config"] = dict(FP8_CONFIG)
            (out / "config.json").write_text(json.dumps(raw))
    return dst


def load_cpu(path: Path, quantization: str | None = None):
    """(model, config) of a tiny checkpoint directory, fp32 on the CPU, through the loader's full path."""
    source, raw, _ = open_checkpoint(path)
    return load_model(source, raw, torch.device("cpu"), torch.float32, 512, progress=False, quantization=quantization)
