"""Bad checkpoints and paths fail early with a message naming the problem (never a deep traceback)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_tfm.errors import CheckpointError
from dflash_tfm.loading.loader import load_target, open_checkpoint

from ..models.tiny_targets import save_hf_model
from .checkpoint_edits import check, copy_checkpoint, edit_weights


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    _, path = save_hf_model("qwen3", tmp_path_factory.mktemp("ckpt"))
    return path


def test_missing_path_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        open_checkpoint(tmp_path / "does-not-exist")


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        open_checkpoint(tmp_path)


def test_unknown_architecture_lists_supported(llama_dir: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(llama_dir, tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"gpt2.*supported: llama, qwen3"):
        load_target(path, torch.device("cpu"), torch.float32, progress=False)


def test_wrong_shape_names_key_and_both_shapes(llama_dir: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(llama_dir, tmp_path / "m")
    edit_weights(path, lambda t: t.__setitem__("model.layers.1.mlp.down_proj.weight", torch.zeros(64, 90)))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.down_proj\.weight.*expected shape \[64, 96\], found \[64, 90\]"):
        check(path)


def test_missing_tensor_is_named(llama_dir: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(llama_dir, tmp_path / "m")
    edit_weights(path, lambda t: t.pop("model.layers.2.self_attn.k_norm.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.2\.self_attn\.k_norm\.weight'"):
        check(path)


def test_unexpected_tensor_is_named(llama_dir: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(llama_dir, tmp_path / "m")
    edit_weights(path, lambda t: t.__setitem__("model.layers.0.extra.weight", torch.zeros(3)))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.extra\.weight'"):
        check(path)


def test_config_that_does_not_fit_the_weights(llama_dir: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(llama_dir, tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"gate_proj\.weight.*expected shape \[128, 64\], found \[96, 64\]"):
        check(path)


def test_corrupt_safetensors_file(llama_dir: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(llama_dir, tmp_path / "m")
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        check(path)


def test_truncated_safetensors_file(llama_dir: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(llama_dir, tmp_path / "m")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        check(path)


def test_index_naming_a_missing_shard(llama_dir: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(llama_dir, tmp_path / "m")
    names = list(load_file(path / "model.safetensors"))
    index = {"weight_map": {n: ("model-00001-of-00002.safetensors" if i % 2 else "model.safetensors") for i, n in enumerate(names)}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002.safetensors"):
        open_checkpoint(path)


def test_sharded_checkpoint_loads_like_a_single_file(llama_dir: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(llama_dir, tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, path / shard)
    (path / "model.safetensors").unlink()
    index = {"weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    sharded = load_target(path, torch.device("cpu"), torch.float32, progress=False).model
    single = load_target(llama_dir, torch.device("cpu"), torch.float32, progress=False).model
    for (name, a), (_, b) in zip(sharded.named_parameters(), single.named_parameters()):
        assert torch.equal(a, b), name
