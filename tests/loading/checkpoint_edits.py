"""Helpers of the loading tests: copy a saved checkpoint directory, edit its tensors, run the header check."""
from __future__ import annotations

import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from dflash_tfm.config import ModelConfig
from dflash_tfm.loading.loader import check_checkpoint, open_checkpoint


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
    check_checkpoint(source, ModelConfig.from_dict(raw))
