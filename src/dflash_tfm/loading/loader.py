"""Build a target model from a local checkpoint (HF directory or GGUF file) and fill its weights.

Every check happens against the shard headers before any tensor is read, so a mismatched checkpoint fails
in seconds with the key and both shapes named; tensors are then streamed one at a time into parameters
allocated once on the target device (never two full copies of the weights).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Protocol

import torch
from tqdm.auto import tqdm

from dflash_tfm.config import ModelConfig, load_config_file
from dflash_tfm.errors import CheckpointError
from dflash_tfm.loading.safetensors_dir import SafetensorsDir
from dflash_tfm.loading.weight_map import IGNORED, expected_tensors
from dflash_tfm.models.decoder import CausalLM


class CheckpointSource(Protocol):
    def tensor_names(self) -> list[str]: ...
    def tensor_shape(self, name: str) -> tuple[int, ...]: ...
    def load_tensor(self, name: str, dtype: torch.dtype) -> torch.Tensor: ...


@dataclass
class LoadedTarget:
    model: CausalLM
    config: ModelConfig
    tokenizer: object  # a transformers PreTrainedTokenizerFast
    source_path: Path


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """torch's default dtype set to `dtype` inside the block (modules then create their parameters in it)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def open_checkpoint(path: str | Path | None) -> tuple[CheckpointSource, dict, Path]:
    """Resolve a local model path (None = the embedded SmolLM2 GGUF) -> (tensor source, HF config dict, path)."""
    from dflash_tfm.loading.default_model import default_model_path
    from dflash_tfm.loading.gguf_file import open_gguf

    p = default_model_path() if path is None else Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"model path does not exist: {p}")
    if p.is_dir() and not (p / "config.json").is_file():
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            p = ggufs[0]
        else:
            raise FileNotFoundError(f"no config.json in model directory {p} (and not exactly one .gguf file)")
    if p.is_file():
        ckpt = open_gguf(p)
        return ckpt, ckpt.config, p
    return SafetensorsDir(p), load_config_file(p), p


def check_checkpoint(source: CheckpointSource, cfg: ModelConfig) -> None:
    """Raise CheckpointError listing every missing, unexpected or wrongly-shaped tensor."""
    names = set(source.tensor_names())
    specs = expected_tensors(cfg, names)
    problems = []
    for name in sorted(names):
        if IGNORED.search(name) or (cfg.tie_word_embeddings and name == "lm_head.weight"):
            continue
        if name not in specs:
            problems.append(f"unexpected tensor {name!r} (shape {list(source.tensor_shape(name))})")
        elif tuple(source.tensor_shape(name)) != specs[name].shape:
            problems.append(
                f"tensor {name!r}: expected shape {list(specs[name].shape)}, found {list(source.tensor_shape(name))}"
            )
    problems += [f"missing tensor {name!r} (expected shape {list(specs[name].shape)})" for name in sorted(set(specs) - names)]
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise CheckpointError(f"checkpoint does not fit the {cfg.model_type} config:\n  {shown}{more}")


def load_weights(model: CausalLM, source: CheckpointSource, cfg: ModelConfig, progress: bool = True) -> None:
    """Stream every expected tensor from `source` into the model's (fused) parameters."""
    check_checkpoint(source, cfg)
    params = dict(model.named_parameters())
    dtype = model.embed_tokens.dtype
    specs = expected_tensors(cfg, set(source.tensor_names()))
    for name in tqdm(list(specs), desc="loading weights", unit="tensor", disable=not progress, leave=False):
        spec = specs[name]
        with torch.no_grad():
            for param_name, row, piece in spec.assign(source.load_tensor(name, dtype)):
                target, piece = _as_rows(params[param_name]), _as_rows(piece)
                target[row : row + piece.shape[0]].copy_(piece.to(target.dtype))


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """A tensor of more than two dims as the matrix of its last-dim rows (a view), which is how pieces address
    stacked expert weights (`weight_map.Piece`)."""
    return t.flatten(0, -2) if t.dim() > 2 else t


def build_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, max_positions: int) -> CausalLM:
    """Allocate the model's parameters (uninitialised) directly on `device` in `dtype`."""
    with torch.device(device), default_dtype(dtype):
        model = CausalLM(cfg, max_positions)
    return model.eval().requires_grad_(False)


def load_target(
    path: str | Path | None, device: torch.device, dtype: torch.dtype, max_positions: int | None = None,
    progress: bool = True,
) -> LoadedTarget:
    """Load config, tokenizer and weights of a local target checkpoint."""
    source, raw_config, resolved = open_checkpoint(path)
    cfg = ModelConfig.from_dict(raw_config)
    model = build_model(cfg, device, dtype, max_positions or cfg.max_position_embeddings)
    load_weights(model, source, cfg, progress=progress)
    return LoadedTarget(model, cfg, load_tokenizer(source, resolved), resolved)


def load_tokenizer(source: CheckpointSource, path: Path):
    """The checkpoint's own tokenizer and chat template, from local files only."""
    from dflash_tfm.loading.gguf_file import GGUFCheckpoint, load_gguf_tokenizer

    if isinstance(source, GGUFCheckpoint):
        return load_gguf_tokenizer(source)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot load the tokenizer from {path}: {e}") from None
