"""The target's tap-layer features of generated rows, saved beside them (`dflash-tfm gen-data --save-taps`).

A drafter trainer needs the target's tap-layer outputs at every position of every row. Computing them is one
target pass over the data (`FeatureStore`), which for a large target costs about as much as generating it;
a saved file lets several training runs share that pass (`train-dflash --tap-features FILE`). One safetensors
file: ``features`` [total tokens, taps · hidden] in the target's dtype and ``offsets`` [rows + 1] int64 (row i is
``features[offsets[i]:offsets[i + 1]]``, all its prompt + response positions), with metadata ``row_ids`` and
``tap_layer_ids`` (JSON lists). Rows are matched by id, so the file must come from the same data rows.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflash_tfm.train.target_features import FeatureStore, TargetFeatures


def save_tap_features(path: str | Path, row_ids: Sequence[str], row_tokens: Sequence[list[int]],
                      features: TargetFeatures, progress: bool = True) -> None:
    """Run the target once over the rows (``FeatureStore``'s length-sorted batches) and write their tap
    features, in row order, to ``path``."""
    if len(set(row_ids)) != len(row_ids):
        raise ValueError("row ids must be unique to save tap features by id")
    store = FeatureStore(features, row_tokens, with_hidden=False, progress=progress)
    offsets = [0]
    for tokens in row_tokens:
        offsets.append(offsets[-1] + len(tokens))
    save_file({"features": store.features.cpu().contiguous(), "offsets": torch.tensor(offsets, dtype=torch.int64)},
              str(path), metadata={"row_ids": json.dumps(list(row_ids)),
                                   "tap_layer_ids": json.dumps(list(features.tap_layers))})


class SavedTapFeatures:
    """A file written by :func:`save_tap_features`: checked on open, rows read by id."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"tap feature file not found: {self.path}")
        try:
            with safe_open(str(self.path), framework="pt") as f:
                meta = f.metadata() or {}
                self.features = f.get_tensor("features")
                offsets = f.get_tensor("offsets")
            self.row_ids = json.loads(meta["row_ids"])
            self.tap_layer_ids = [int(t) for t in json.loads(meta["tap_layer_ids"])]
        except Exception as e:  # safetensors, key and JSON errors all mean "not a tap feature file"
            raise ValueError(f"{self.path} is not a tap feature file (dflash-tfm gen-data --save-taps): {e}") from None
        if offsets.shape != (len(self.row_ids) + 1,) or int(offsets[-1]) != self.features.shape[0]:
            raise ValueError(f"{self.path}: offsets {tuple(offsets.shape)} do not fit {len(self.row_ids)} rows "
                             f"and {self.features.shape[0]} feature rows")
        self._rows = {rid: (int(offsets[i]), int(offsets[i + 1])) for i, rid in enumerate(self.row_ids)}

    def check_fits(self, tap_layer_ids: Sequence[int], width: int) -> None:
        """Raise ValueError unless the file holds these taps at this total feature width."""
        if list(tap_layer_ids) != self.tap_layer_ids or self.features.shape[1] != width:
            raise ValueError(f"{self.path} holds taps {self.tap_layer_ids} ({self.features.shape[1]} features per "
                             f"position); the drafter needs taps {list(tap_layer_ids)} ({width} features)")

    def store(self, keys: Sequence[str], rows: Sequence[list[int]], device: torch.device) -> FeatureStore:
        """A ``FeatureStore`` of these rows (``keys`` = their data ids; each row may be a truncated prefix)."""
        per_row = []
        for key, tokens in zip(keys, rows):
            if key not in self._rows:
                raise ValueError(f"{self.path} has no features for row {key!r} (saved for other data?)")
            start, end = self._rows[key]
            if end - start < len(tokens):
                raise ValueError(f"{self.path}: row {key!r} has {end - start} positions saved, the data has "
                                 f"{len(tokens)} (saved for other data?)")
            per_row.append(self.features[start:end])
        return FeatureStore.from_saved(rows, per_row, device)
