"""Continuous batching of autoregressive decoding: requests join and leave a running batch between steps.

Why: a server that decodes one request at a time keeps every other client waiting although a decode step of
a few rows costs little more than one (the step reads all the weights either way). Here each running request
owns one row (slot) of the `BatchRunner`'s cache; a `step` prefills at most one newcomer (so a long prompt delays
the running requests by one prefill, never by a queue of them), then runs ONE target forward over every running
request, each at its own position, and samples each row with the request's own settings and generator. Finished
requests leave at once and free their slot for the next newcomer.

A request's tokens do not depend on which others share its steps: rows never read each other's caches, greedy
rows take their own argmax, and a sampled row draws from its own seeded generator in the same order as when it
decodes alone. Newcomers take the lowest free slot, so busy rows stay packed at the front and a step runs the
smallest batch bucket that covers them.
"""
from __future__ import annotations

import collections
import time

from dflash_tfm.engine.batch_runner import BatchRunner
from dflash_tfm.engine.sequence import Sequence, StreamDelta
from dflash_tfm.sampling import sample


class ContinuousBatch:
    def __init__(self, runner: BatchRunner) -> None:
        self.runner = runner
        self._slots: list[Sequence | None] = [None] * runner.slots
        self._to_prefill: collections.deque[Sequence] = collections.deque()

    @property
    def running(self) -> int:
        """Requests holding a slot (waiting for their prefill or decoding)."""
        return sum(seq is not None for seq in self._slots)

    @property
    def free_slots(self) -> int:
        return self.runner.slots - self.running

    def add(self, seq: Sequence) -> None:
        """Give `seq` the lowest free slot; its prefill runs in a coming `step`."""
        if not self.free_slots:
            raise RuntimeError(f"all {self.runner.slots} slots are running (max_running_requests); "
                               "add a request only while free_slots > 0")
        seq.slot = self._slots.index(None)
        self._slots[seq.slot] = seq
        self._to_prefill.append(seq)

    def abort(self, seq: Sequence) -> None:
        """Stop `seq` now and free its slot (a no-op once it finished or left)."""
        if 0 <= seq.slot < len(self._slots) and self._slots[seq.slot] is seq:
            self._release(seq)

    def _release(self, seq: Sequence) -> None:
        self._slots[seq.slot] = None
        if seq in self._to_prefill:
            self._to_prefill.remove(seq)

    def _push(self, seq: Sequence, token: int) -> StreamDelta:
        delta = seq.push(token)
        if seq.finished:
            self._release(seq)
        return delta

    def step(self) -> list[tuple[Sequence, StreamDelta]]:
        """Prefill one newcomer (if any), then decode one token for every running request -> each produced
        token as (request, delta), in slot order; a request's last delta has its finish reason."""
        out: list[tuple[Sequence, StreamDelta]] = []
        if self._to_prefill:
            seq = self._to_prefill.popleft()
            start = time.perf_counter()
            logits = self.runner.prefill(seq.slot, seq.prompt_ids)
            token = int(sample(logits, seq.params, seq.generator).item())
            seq.decode_started = time.perf_counter()
            seq.stats.prefill_seconds = seq.decode_started - start
            seq.stats.verify_steps = 1  # the prefill forward produced the first token
            seq.length = len(seq.prompt_ids)
            out.append((seq, self._push(seq, token)))
        decoding = {s.slot: s for s in self._slots if s is not None and s not in self._to_prefill}
        if not decoding:
            return out
        logits = self.runner.decode({slot: s.last_token for slot, s in decoding.items()},
                                    {slot: s.length for slot, s in decoding.items()})
        greedy = logits.argmax(dim=-1).tolist()  # one host read for every greedy row
        for slot, seq in decoding.items():
            seq.length += 1  # its last token is in the cache now
            stats = seq.stats
            stats.verify_steps += 1
            stats.draft_sizes[0] = stats.draft_sizes.get(0, 0) + 1  # a plain decode step: no drafts
            token = greedy[slot] if seq.params.greedy else int(sample(logits[slot : slot + 1], seq.params,
                                                                      seq.generator).item())
            out.append((seq, self._push(seq, token)))
        return out
