"""Build a target model from a local checkpoint (HF directory or GGUF file) and fill its weights.

Every check happens against the shard headers before any tensor is read, so a mismatched checkpoint fails
in seconds with the key and both shapes named; tensors are then streamed one at a time into parameters
allocated once on the target device (never two full copies of the weights). Projections are allocated only
once the checkpoint's names say in which format each is held (BF16, or FP8 with block scales:
`fp8_layout.py`), so an FP8 checkpoint never occupies its BF16 size.
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
from dflash_tfm.kernels.fp8.block_quant import dequantize_rows, expand_block_scales, quantize_blocks
from dflash_tfm.layers.fp8_weight import Fp8Weight
from dflash_tfm.layers.linear import deferred_projection_weights
from dflash_tfm.loading.fp8_layout import (
    KEPT_DENSE, SCALE_SUFFIX, allocate_projections, fp8_plan, scale_name, scale_problems, slice_row_scales, stored_fp8,
)
from dflash_tfm.loading.quantization import FP8, check_quantization_flag, checkpoint_quantization
from dflash_tfm.loading.safetensors_dir import SafetensorsDir
from dflash_tfm.loading.weight_map import IGNORED, TensorSpec, expected_tensors
from dflash_tfm.models.decoder import CausalLM
from dflash_tfm.parallel.sharding import Part, Shard


class CheckpointSource(Protocol):
    def tensor_names(self) -> list[str]: ...
    def tensor_shape(self, name: str) -> tuple[int, ...]: ...
    def tensor_dtype(self, name: str) -> str: ...
    def load_tensor(self, name: str, dtype: torch.dtype | None, part: Part | None = None) -> torch.Tensor: ...


@dataclass
class LoadedTarget:
    model: CausalLM
    config: ModelConfig
    tokenizer: object  # a transformers PreTrainedTokenizerFast
    source_path: Path


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def native_cpu_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX). There bf16 is the fast dtype: on a
    2-core EPYC with AVX512-BF16 the SmolLM2 lm_head ran 3.0× (1 row) to 4.0× (17 rows) faster than in fp32 and
    autoregressive decoding 1.6×; without it bf16 matmuls are emulated, slower than fp32."""
    return any(getattr(torch.cpu, probe, lambda: False)()
               for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def auto_dtype(device: torch.device) -> torch.dtype:
    """What dtype "auto" means on `device`: bfloat16 on CUDA and on CPUs with native bf16, float32 elsewhere."""
    return torch.bfloat16 if device.type == "cuda" or native_cpu_bf16() else torch.float32


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


def check_checkpoint(source: CheckpointSource, cfg: ModelConfig, quantization: str | None = None) -> None:
    """Raise CheckpointError listing every missing, unexpected or wrongly-shaped tensor (and, for an FP8
    checkpoint, every scale that does not fit its weight). `quantization` is what config.json declares."""
    names = set(source.tensor_names())
    specs = expected_tensors(cfg, names)
    problems = scale_problems(source, specs, quantization == FP8)
    for name in sorted(names):
        if IGNORED.search(name) or (cfg.tie_word_embeddings and name == "lm_head.weight"):
            continue
        if name.endswith(SCALE_SUFFIX):  # checked by scale_problems
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


def load_weights(model: CausalLM, source: CheckpointSource, cfg: ModelConfig, progress: bool = True,
                 stored_quantization: str | None = None, quantization: str | None = None,
                 shard: Shard = Shard()) -> None:
    """Stream every expected tensor from `source` into the model's (fused) parameters; at tensor-parallel size
    > 1 only this rank's slice of each (`shard`).

    `stored_quantization` is what config.json declares (`quantization.checkpoint_quantization`); with
    `quantization` "fp8" the BF16 projections are quantized at load. Projections still on the meta device
    (`deferred_projection_weights`) are allocated here, in FP8 where the checkpoint or the flag makes them FP8."""
    check_checkpoint(source, cfg, stored_quantization)
    names = set(source.tensor_names())
    specs = expected_tensors(cfg, names, shard)
    device, dtype = model.embed_tokens.device, model.embed_tokens.dtype
    stored = stored_fp8(names) & set(specs)
    projections = {n for n, p in model.named_parameters() if p.is_meta}
    wanted = stored | ({n for n in specs if not KEPT_DENSE.search(n)} if quantization == FP8 else set())
    held_fp8 = {n for n in wanted if _destinations(specs[n]) <= projections}
    allocate_projections(model, fp8_plan(specs, held_fp8), device, dtype)
    params = dict(model.named_parameters())
    holders = {n: m for n, m in model.named_modules() if isinstance(m, Fp8Weight)}
    for name in tqdm(list(specs), desc="loading weights", unit="tensor", disable=not progress, leave=False):
        spec = specs[name]
        with torch.no_grad():
            weight, scales = _read(source, name, spec, name in stored, name in held_fp8, device, dtype)
            pieces = spec.assign(weight)
            scale_pieces = [None] * len(pieces) if scales is None else [p for _, _, p in spec.assign(scales)]
            for (param_name, row, piece), scale in zip(pieces, scale_pieces):
                if param_name in holders:  # FP8 rows with their scales, or the holder's exact rows
                    holders[param_name].write_rows(row, _as_rows(piece), None if scale is None else _as_rows(scale))
                    continue
                target, piece = _as_rows(params[param_name]), _as_rows(piece)
                target[row : row + piece.shape[0]].copy_(piece.to(target.dtype))


def _read(source: CheckpointSource, name: str, spec: TensorSpec, stored_fp8: bool, held_fp8: bool,
          device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One checkpoint tensor (this rank's slice, `spec.part`) as it will be held: (FP8 weight, per-row scales) or
    (`dtype` weight, None). An FP8 tensor held densely is dequantized; a dense one held in FP8 is quantized in
    128 x 128 blocks of the slice (on `device`)."""
    part = spec.part
    if stored_fp8:
        weight = source.load_tensor(name, None, part)
        scales = expand_block_scales(source.load_tensor(scale_name(name), torch.float32), spec.shape[-2])
        scales = slice_row_scales(scales, part, name, spec.shape[-1])
        return (weight, scales) if held_fp8 else (dequantize_rows(weight, scales, dtype), None)
    if not held_fp8:
        return source.load_tensor(name, dtype, part), None
    weight, block_scales = quantize_blocks(source.load_tensor(name, torch.float32, part).to(device))
    return weight, expand_block_scales(block_scales, weight.shape[-2])


def _destinations(spec) -> set[str]:
    """The parameters a checkpoint tensor is written into."""
    return {param for param, _, _ in spec.assign(torch.empty(spec.read_shape, device="meta"))}


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """A tensor of more than two dims as the matrix of its last-dim rows (a view), which is how pieces address
    stacked expert weights (`weight_map.Piece`)."""
    return t.flatten(0, -2) if t.dim() > 2 else t


def build_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, max_positions: int,
                shard: Shard = Shard()) -> CausalLM:
    """Allocate the model's parameters (uninitialised) directly on `device` in `dtype`: one tensor-parallel
    rank's slice (`shard`)."""
    with torch.device(device), default_dtype(dtype):
        model = CausalLM(cfg, max_positions, shard)
    return model.eval().requires_grad_(False)


def load_target(
    path: str | Path | None, device: torch.device, dtype: torch.dtype, max_positions: int | None = None,
    progress: bool = True, quantization: str | None = None, shard: Shard = Shard(),
) -> LoadedTarget:
    """Load config, tokenizer and weights of a local target checkpoint; `quantization` "fp8" holds its BF16
    projections in FP8 (`fp8_layout.py` says which); `shard` the tensor-parallel rank whose slice is loaded."""
    source, raw_config, resolved = open_checkpoint(path)
    model, cfg = load_model(source, raw_config, device, dtype, max_positions, progress, quantization, shard)
    return LoadedTarget(model, cfg, load_tokenizer(source, resolved), resolved)


def load_model(
    source: CheckpointSource, raw_config: dict, device: torch.device, dtype: torch.dtype,
    max_positions: int | None = None, progress: bool = True, quantization: str | None = None,
    shard: Shard = Shard(),
) -> tuple[CausalLM, ModelConfig]:
    """The target model of an opened checkpoint, weights loaded: the config's quantization (None or FP8) and the
    `quantization` flag checked first, projections allocated in the format they are held in. At tensor-parallel
    size > 1 (`shard`) each rank reads its slices, an FP8 tensor's with its block scales' (`slice_row_scales`)."""
    quantization = check_quantization_flag(quantization)
    stored_quantization = checkpoint_quantization(raw_config)
    cfg = ModelConfig.from_dict(raw_config)
    with deferred_projection_weights():
        model = build_model(cfg, device, dtype, max_positions or cfg.max_position_embeddings, shard)
    load_weights(model, source, cfg, progress=progress, stored_quantization=stored_quantization,
                 quantization=quantization, shard=shard)
    return model, cfg


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
