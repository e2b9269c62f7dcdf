"""The frozen target's outputs that drafter and Weaver training consume: tap-layer features and final hidden states.

`TargetFeatures` runs the target over a padded batch. `FeatureStore` runs it once over every training row and
keeps the outputs on the device, so an optimizer step gathers them instead of re-running the target: the target
never changes during training, and for a small drafter its forward was a large part of each step. A row's stored
outputs are those of the row alone (right padding cannot reach earlier positions: attention is causal and Gated
DeltaNet is a recurrence), so both paths give the same numbers up to the target's own batching round-off.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from dflash_tfm.models.cache import ModelCache
from dflash_tfm.models.decoder import CausalLM
from dflash_tfm.train.shapes import padded_length

CPU_STORE_BYTES = 1 << 30  # on the CPU the store is used up to this size
GPU_STORE_FRACTION = 0.6  # on CUDA up to this fraction of the free device memory (a small target's training
# needs little beside it; at 0.3 an H200 could not keep Weaver's 49 GiB store for 34k rows of SmolLM2)


class TargetFeatures:
    """The frozen target as a feature extractor over a right-padded batch."""

    def __init__(self, model: CausalLM, tap_layers: list[int], max_len: int) -> None:
        self.model, self.tap_layers, self.max_len = model, tuple(tap_layers), max_len
        self.caches: dict[int, ModelCache] = {}

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [b, T] -> the tap layers' outputs concatenated, [b, T, len(taps) * hidden]."""
        return self.hidden_and_features(tokens)[1]

    @torch.no_grad()
    def hidden_and_features(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Also the final-normed hidden states [b, T, hidden] of the same pass (Weaver training needs both)."""
        b, T = tokens.shape
        if b not in self.caches:
            embed = self.model.embed_tokens
            self.caches[b] = ModelCache(self.model.config, self.max_len, b, embed.dtype, embed.device)
        cache = self.caches[b]
        cache.reset()
        positions = torch.arange(T, device=tokens.device).expand(b, T)
        hidden, taps = self.model(tokens, positions, cache, kv_len=T, tap_layers=self.tap_layers)
        return hidden, torch.cat(taps, dim=-1)


def store_fits(num_tokens: int, width: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `num_tokens` rows of `width` values fit the store's memory rule (module constants). When they do
    not, says so: the trainer then runs the target every step, several times slower, which should not pass
    unnoticed."""
    need = num_tokens * width * torch.finfo(dtype).bits // 8
    if device.type == "cuda":
        allowed = int(GPU_STORE_FRACTION * torch.cuda.mem_get_info(device)[0])
        rule = f"{GPU_STORE_FRACTION:.0%} of the free device memory"
    else:
        allowed, rule = CPU_STORE_BYTES, "the CPU store limit"
    if need > allowed:
        print(f"target features of {num_tokens:,} tokens need {need / 2**30:.1f} GiB, over {allowed / 2**30:.1f} "
              f"GiB ({rule}): running the target every step instead of keeping them", file=sys.stderr)
    return need <= allowed


class FeatureStore:
    """Every row's target outputs, computed once (rows sorted by length, `batch_rows` per target pass, padded to
    `padded_length`) and kept flat on the target's device. Rows are looked up by the identity of their token
    list: the trainers' own row objects, alive for the whole run, are passed back unchanged."""

    def __init__(self, features: TargetFeatures, rows: Sequence[list[int]], *, with_hidden: bool,
                 batch_rows: int = 32, progress: bool = True) -> None:
        lengths, starts = self._layout(rows)
        embed = features.model.embed_tokens
        device, dtype, hidden = embed.device, embed.dtype, embed.shape[1]
        self.features = torch.empty(starts[-1], hidden * len(features.tap_layers), dtype=dtype, device=device)
        self.hidden = torch.empty(starts[-1], hidden, dtype=dtype, device=device) if with_hidden else None
        order = sorted(range(len(rows)), key=lengths.__getitem__)
        for i in tqdm(range(0, len(order), batch_rows), desc="target features", unit="batch", disable=not progress):
            group = order[i : i + batch_rows]
            T = padded_length(lengths[group[-1]], features.max_len)
            tokens = torch.zeros(len(group), T, dtype=torch.long)
            for j, r in enumerate(group):
                tokens[j, : lengths[r]] = torch.tensor(rows[r])
            h, f = features.hidden_and_features(tokens.to(device))
            for j, r in enumerate(group):
                rows_at = slice(starts[r], starts[r] + lengths[r])
                self.features[rows_at] = f[j, : lengths[r]]
                if self.hidden is not None:
                    self.hidden[rows_at] = h[j, : lengths[r]]

    def _layout(self, rows: Sequence[list[int]]) -> tuple[list[int], list[int]]:
        """Row lengths and flat start offsets (rows back to back, in the given order); indexes rows by identity."""
        lengths = [len(r) for r in rows]
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        self._slot = {id(r): (s, n) for r, s, n in zip(rows, starts, lengths)}
        return lengths, starts

    @classmethod
    def from_saved(cls, rows: Sequence[list[int]], per_row: Sequence[torch.Tensor],
                   device: torch.device) -> FeatureStore:
        """A store of tap features computed earlier (``tap_file.SavedTapFeatures``): ``per_row[i]`` holds at least
        ``len(rows[i])`` positions of row i (its first ones are used: a truncated row's features are a prefix);
        no final hidden states."""
        store = cls.__new__(cls)
        lengths, _ = store._layout(rows)
        store.features = torch.cat([f[:n] for f, n in zip(per_row, lengths)]).to(device)
        store.hidden = None
        return store

    def __contains__(self, row: list[int]) -> bool:
        return id(row) in self._slot

    def _index(self, rows: Sequence[list[int]], T: int) -> torch.Tensor:
        """[b, T] flat indices of each row's positions 0 … T−1; positions past a row's end repeat its last one
        (padding: never context of a real position)."""
        start, length = zip(*(self._slot[id(r)] for r in rows))
        steps = torch.arange(T).expand(len(rows), T)
        index = torch.tensor(start)[:, None] + torch.minimum(steps, torch.tensor(length)[:, None] - 1)
        return index.to(self.features.device)

    def gather(self, rows: Sequence[list[int]], T: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(hidden [b, T, H] or None without `with_hidden`, features [b, T, taps·H]) of `rows`, padded to T."""
        index = self._index(rows, T)
        return None if self.hidden is None else self.hidden[index], self.features[index]
