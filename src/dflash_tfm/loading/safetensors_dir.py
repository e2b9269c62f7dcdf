"""Reading a Hugging Face model directory: config.json + one or many (indexed) safetensors shards.

Tensors are read one at a time through safetensors' lazy `safe_open`, so loading never holds the whole
checkpoint in memory next to the model.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from dflash_tfm.errors import CheckpointError
from dflash_tfm.parallel.sharding import Part

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class SafetensorsDir:
    """`tensor_names()`, `tensor_shape(name)`, `load_tensor(name, dtype)` over a HF directory's shards."""

    def __init__(self, model_dir: str | Path) -> None:
        self.path = Path(model_dir)
        if not self.path.is_dir():
            raise FileNotFoundError(f"model directory not found: {self.path}")
        self._file_of: dict[str, Path] = {}
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from None
            for name, shard in weight_map.items():
                self._file_of[name] = self.path / shard
        else:
            shards = sorted(self.path.glob("*.safetensors"))
            if not shards:
                raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} (or any *.safetensors) in {self.path}")
            for shard in shards:
                for name in self._open(shard).keys():
                    self._file_of[name] = shard
        missing = sorted({str(p) for p in self._file_of.values() if not p.is_file()})
        if missing:
            raise FileNotFoundError(f"shard file(s) named in {INDEX_FILE} are missing: {', '.join(missing)}")
        self._handles: dict[Path, object] = {}

    def _open(self, shard: Path):
        try:
            return safe_open(str(shard), framework="pt")
        except Exception as e:  # safetensors raises its own error types for bad headers
            raise CheckpointError(f"cannot read safetensors file {shard}: {e}") from None

    def _handle(self, name: str):
        shard = self._file_of[name]
        if shard not in self._handles:
            self._handles[shard] = self._open(shard)
        return self._handles[shard]

    def tensor_names(self) -> list[str]:
        return list(self._file_of)

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def tensor_dtype(self, name: str) -> str:
        """The stored dtype's safetensors name (BF16, F8_E4M3, ...), read from the header."""
        return self._handle(name).get_slice(name).get_dtype()

    def load_tensor(self, name: str, dtype: torch.dtype | None, part: Part | None = None) -> torch.Tensor:
        """One tensor converted to `dtype` (None: as stored, e.g. FP8 weights). With `part` (a tensor-parallel
        rank's slice, `parallel/sharding.py`) only those ranges are read from the file, concatenated."""
        try:
            if part is None:
                tensor = self._handle(name).get_tensor(name)
            else:
                dim, ranges = part
                view = self._handle(name).get_slice(name)
                lead = (slice(None),) * (dim % len(view.get_shape()))
                tensor = torch.cat([view[(*lead, slice(start, start + n))] for start, n in ranges], dim=dim)
            return tensor if dtype is None else tensor.to(dtype)
        except Exception as e:
            raise CheckpointError(f"cannot read tensor {name!r} from {self._file_of[name]}: {e}") from None
