"""The slots of a continuous batch: which request holds which cache row, and which still wait for their prompt.

Shared by the autoregressive (`ContinuousBatch`) and speculative (`SpeculativeBatch`) batches, which differ only in
their `step`. A newcomer takes the lowest free slot, so busy rows stay packed at the front and a step runs the
smallest batch bucket that covers them; admission resets the row's recurrent state before any step feeds it.
"""
from __future__ import annotations

import collections

from dflash_tfm.engine.batch_runner import BatchRunner
from dflash_tfm.engine.sequence import Sequence


class BatchSlots:
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
        """Give `seq` the lowest free slot; its prompt is fed by the coming steps."""
        if not self.free_slots:
            raise RuntimeError(f"all {self.runner.slots} slots are running (max_running_requests); "
                               "add a request only while free_slots > 0")
        seq.slot = self._slots.index(None)
        self._slots[seq.slot] = seq
        self._to_prefill.append(seq)
        self.runner.reset_row(seq.slot)  # before any step feeds it: a row in a step's bucket is stepped

    def holds(self, seq: Sequence) -> bool:
        """Whether `seq` still holds its slot (admitted, not finished, not aborted)."""
        return 0 <= seq.slot < len(self._slots) and self._slots[seq.slot] is seq

    def in_slot(self, slot: int) -> Sequence | None:
        return self._slots[slot]

    def abort(self, seq: Sequence) -> None:
        """Stop `seq` now and free its slot (a no-op once it finished or left)."""
        if self.holds(seq):
            self._release(seq)

    def _release(self, seq: Sequence) -> None:
        self._slots[seq.slot] = None
        if seq in self._to_prefill:
            self._to_prefill.remove(seq)
