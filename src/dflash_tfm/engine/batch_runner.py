"""The target's batched decode step over the rows of one static cache, for continuous batching.

Why a runner of its own: `ModelRunner` is batch 1 (its decode graphs and tuned one-row projections assume a
single row), while serving many requests needs one target forward over every running sequence, each at its own
position in its own cache row. A row is a request's slot: a prefill chunk writes only that row
(`ModelCache.rows`), and a decode step feeds one token per row at per-row positions (attention masks each row's
keys beyond its own position, Gated-DeltaNet states and conv windows are per row).

A step runs only the first `batch_bucket(n)` rows (the smallest power of two covering the busiest slot, so a lone
request does not pay for a full batch) and reads a bucketed key length (`key_length_bucket`): on CUDA each
(batch bucket, key-length bucket) pair is one graph (`PhaseGraphs`, state-advancing: its first step runs eagerly
and is captured for the next ones). Rows inside the bucket that hold no request decode a dummy token at
position 0; their output is ignored and admission resets the row (`reset_row`) before it is fed.
"""
from __future__ import annotations

import contextlib

import torch

from dflash_tfm.engine.model_runner import key_length_bucket, prefill_in_chunks
from dflash_tfm.engine.phase_graphs import PhaseGraphs
from dflash_tfm.layers.linear import skinny_projections
from dflash_tfm.models.cache import ModelCache
from dflash_tfm.models.decoder import CausalLM


def batch_bucket(rows: int, slots: int) -> int:
    """Smallest power of two >= rows, capped at `slots`: the batch sizes a step runs at (one graph each)."""
    b = 1
    while b < rows:
        b *= 2
    return min(b, slots)


class BatchRunner:
    """`slots` cache rows of `max_len` tokens and the batched decode step over them."""

    def __init__(self, model: CausalLM, slots: int, max_len: int, device: torch.device, *,
                 use_cuda_graph: bool = True) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.model, self.slots, self.max_len, self.device = model, slots, max_len, device
        self.cache = ModelCache(model.config, max_len, slots, model.embed_tokens.dtype, device)
        # Up to 8 key-length buckets per batch bucket stay captured (there are at most bit_length + 1 of those).
        self.graphs = PhaseGraphs(use_cuda_graph and device.type == "cuda", per_phase=8 * (slots.bit_length() + 1))
        # Static step buffers (the graphs read and write these addresses); a bucket uses their first rows.
        self._ids = torch.zeros(slots, 1, dtype=torch.long, device=device)
        self._positions = torch.zeros(slots, 1, dtype=torch.long, device=device)
        self._logits: dict[int, torch.Tensor] = {}  # batch bucket -> fp32 logits [bucket, V]

    def reset_row(self, slot: int) -> None:
        """Start a new sequence in row `slot`: its recurrent state and conv window back to zero."""
        self.cache.row(slot).reset()

    @torch.inference_mode()
    def prefill(self, slot: int, token_ids: list[int], start: int = 0) -> torch.Tensor:
        """Feed a chunk of a prompt, `token_ids` at positions start.., into row `slot` in one forward -> fp32
        logits [1, V] of its last token."""
        if not token_ids or start + len(token_ids) >= self.max_len:
            raise ValueError(f"{len(token_ids)} prompt tokens at position {start} do not fit cache rows of "
                             f"{self.max_len}")
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        last = prefill_in_chunks(self.model, ids, self.cache.row(slot), start, len(token_ids))
        return self.model.logits(last.view(1, -1))

    @torch.inference_mode()
    def decode(self, tokens: dict[int, int], positions: dict[int, int]) -> torch.Tensor:
        """One token per busy row (`tokens`, `positions`: slot -> value) -> fp32 logits [bucket, V], row r the
        logits of slot r; advances every busy row's caches by one token."""
        bucket = batch_bucket(max(tokens) + 1, self.slots)
        if max(positions.values()) >= self.max_len:
            raise ValueError(f"a position is beyond the cache rows' {self.max_len} tokens")
        kv_len = key_length_bucket(max(positions.values()), self.max_len)
        ids, pos = torch.zeros(bucket, 1, dtype=torch.long), torch.zeros(bucket, 1, dtype=torch.long)
        for slot, token in tokens.items():
            ids[slot, 0], pos[slot, 0] = token, positions[slot]
        self._ids[:bucket].copy_(ids)
        self._positions[:bucket].copy_(pos)
        cache = self.cache.rows(0, bucket)

        def step() -> None:
            # One row may take the tuned one-row projections, as `ModelRunner`'s decode step does.
            with skinny_projections() if bucket == 1 else contextlib.nullcontext():
                hidden, _ = self.model(self._ids[:bucket], self._positions[:bucket], cache, kv_len=kv_len)
                logits = self.model.logits(hidden[:, -1])
            if bucket not in self._logits:
                self._logits[bucket] = torch.empty_like(logits)
            self._logits[bucket].copy_(logits)

        self.graphs.run(("decode", bucket, kv_len), step, advances_state=True)
        return self._logits[bucket]

