"""Continuous batching of autoregressive decoding: requests join and leave a running batch between steps.

Why: a server that decodes one request at a time keeps every other client waiting although a decode step of
a few rows costs little more than one (the step reads all the weights either way). Here each running request
owns one row (slot) of the `BatchRunner`'s cache; a `step` feeds one chunk of at most `prefill_chunk` prompt
tokens of one newcomer (so a long prompt delays the running requests by one chunk per step, never by whole
prompts), then runs ONE target forward over every busy row, each at its own position, and samples each decoding
row with its request's own settings and generator. Newcomers still in their prompt feed their next prompt token
in that forward (every row of the step's batch bucket is stepped whatever it holds, and only a real token keeps
a row's caches right), so they also advance one prompt token per step besides the chunks. A request draws its
first token from the forward that feeds its last prompt token and decodes with the others from then on.
Finished requests leave at once and free their slot for the next newcomer.

A request's tokens do not depend on which others share its steps: rows never read each other's caches, greedy
rows take their own argmax, and a sampled row draws from its own seeded generator in the same order as when it
decodes alone. Newcomers take the lowest free slot, so busy rows stay packed at the front and a step runs the
smallest batch bucket that covers them.
"""
from __future__ import annotations

import time

import torch

from dflash_tfm.engine.batch_runner import BatchRunner
from dflash_tfm.engine.batch_slots import BatchSlots
from dflash_tfm.engine.sequence import Sequence, StreamDelta
from dflash_tfm.sampling import sample


class ContinuousBatch(BatchSlots):
    def __init__(self, runner: BatchRunner, prefill_chunk: int = 2048) -> None:
        """`prefill_chunk`: the most prompt tokens one step feeds (a bound on activation memory as well as on
        how long a newcomer's prefill holds up the running requests; `ModelRunner` prefills in the same chunks)."""
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        super().__init__(runner)
        self.prefill_chunk = prefill_chunk

    def _push(self, seq: Sequence, token: int) -> StreamDelta:
        delta = seq.push(token)
        if seq.finished:
            self._release(seq)
        return delta

    def _first_token(self, seq: Sequence, logits: torch.Tensor) -> StreamDelta:
        """`seq`'s prompt is all in its row: draw its first token from the last prompt token's logits [1, V]."""
        self._to_prefill.remove(seq)
        seq.decode_started = time.perf_counter()
        seq.stats.verify_steps = 1  # the forward that fed the last prompt token produced the first token
        return self._push(seq, int(sample(logits, seq.params, seq.generator).item()))

    def step(self) -> list[tuple[Sequence, StreamDelta]]:
        """Feed one prompt chunk of the oldest newcomer (if any), then advance every busy row by one token ->
        each produced token as (request, delta); a request's last delta has its finish reason."""
        out: list[tuple[Sequence, StreamDelta]] = []
        if self._to_prefill:
            seq = self._to_prefill[0]
            start = time.perf_counter()
            end = min(len(seq.prompt_ids), seq.length + self.prefill_chunk)
            logits = self.runner.prefill(seq.slot, seq.prompt_ids[seq.length : end], seq.length)
            seq.length = end
            seq.stats.prefill_seconds += time.perf_counter() - start
            if end == len(seq.prompt_ids):
                out.append((seq, self._first_token(seq, logits)))
        # Every busy row takes part: a row still in its prompt feeds its next prompt token (rows inside the
        # step's batch bucket are stepped whatever they hold, and only a real token keeps a row's state right).
        rows = {s.slot: s for s in self._slots if s is not None}
        if not rows:
            return out
        inputs = {slot: s.prompt_ids[s.length] if s.length < len(s.prompt_ids) else s.last_token
                  for slot, s in rows.items()}
        logits = self.runner.decode(inputs, {slot: s.length for slot, s in rows.items()})
        greedy = logits.argmax(dim=-1).tolist()  # one host read for every greedy row
        for slot, seq in rows.items():
            in_prompt = seq.length < len(seq.prompt_ids)
            seq.length += 1  # the token it fed is in the cache now
            if in_prompt:
                if seq.length == len(seq.prompt_ids):
                    out.append((seq, self._first_token(seq, logits[slot : slot + 1])))
                continue
            seq.stats.count_step(drafts=0, produced=1)  # a plain decode step
            token = greedy[slot] if seq.params.greedy else int(sample(logits[slot : slot + 1], seq.params,
                                                                      seq.generator).item())
            out.append((seq, self._push(seq, token)))
        return out
