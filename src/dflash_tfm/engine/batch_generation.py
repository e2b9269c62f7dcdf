"""Many sequences at once on one target: continuous batching over the rows of one static cache.

Why: decoding one sequence leaves a GPU almost idle (and separate processes do not help: without MPS the GPU
time-slices between them), while generating training data needs throughput, not latency. Every step decodes
one token for all rows, each at its own position (attention masks keys per row, see `causal_cache_attention`);
a row whose sequence ends takes the next prompt at once and feeds it through those same steps, one prompt token
per step, from a zeroed recurrent state. So no row ever holds padding (a Gated-DeltaNet state would absorb pad
tokens) and nothing runs outside the batched step: a separate eager prefill per prompt (~400 kernel launches
for SmolLM2) cost more than the batched step itself and left the GPU idle meanwhile.

The step is `BatchRunner.decode`, the step the server's continuous batching runs (on CUDA a graph per batch
and key-length bucket). Sampling uses one generator for the whole batch, so a run reproduces given the same
prompts, slot count and seed, but a row's tokens depend on which rows share its steps (use `Engine` for
per-request seeds).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

from dflash_tfm.engine.batch_runner import BatchRunner
from dflash_tfm.sampling import make_generator, sample
from dflash_tfm.models.decoder import CausalLM
from dflash_tfm.sampling_params import SamplingParams

Key = TypeVar("Key")


@dataclass
class _Row(Generic[Key]):
    key: Key
    prompt: list[int]
    budget: int  # new tokens this row may still produce, context end included
    length: int = 0  # tokens fed into the cache row so far (prompt first, then the sampled tokens)
    tokens: list[int] = field(default_factory=list)

    def next_input(self) -> int:
        """The token this row feeds in the next step: its prompt's next one, then its last sampled one."""
        return self.prompt[self.length] if self.length < len(self.prompt) else self.tokens[-1]


class BatchGenerator:
    """Greedy or sampled generation of many prompts with ``slots`` rows decoded together.

    ``stop_ids`` end a sequence (the stop token is kept, as `Engine.generate` keeps it); a sequence also ends
    after ``max_new_tokens`` or at the end of the ``max_len``-token cache rows.
    """

    def __init__(self, model: CausalLM, slots: int, max_len: int, stop_ids: Iterable[int], *,
                 use_cuda_graph: bool = True) -> None:
        self.device = model.embed_tokens.device
        self.slots = slots
        self.max_len = max_len
        self.stop_ids = set(stop_ids)
        self.runner = BatchRunner(model, slots, max_len, self.device, use_cuda_graph=use_cuda_graph)

    @torch.inference_mode()
    def generate(
        self, prompts: Iterable[tuple[Key, list[int]]], max_new_tokens: int, params: SamplingParams,
    ) -> Iterator[tuple[Key, list[int]]]:
        """Yield ``(key, response_ids)`` for every prompt, in the order they finish."""
        params.validate()
        generator = make_generator(params, self.device)
        pending = iter(prompts)
        rows: list[_Row[Key] | None] = [None] * self.slots

        def admit(slot: int) -> None:
            """Give ``slot`` the next prompt (if any), from a zero recurrent state; it is fed by the next steps."""
            rows[slot] = None
            for key, ids in pending:
                if not ids or len(ids) >= self.max_len:
                    raise ValueError(f"prompt {key!r} has {len(ids)} tokens; the cache rows hold {self.max_len}")
                self.runner.reset_row(slot)
                rows[slot] = _Row(key, list(ids), min(max_new_tokens, self.max_len - len(ids)))
                return

        def done(row: _Row[Key]) -> bool:
            return bool(row.tokens) and (row.tokens[-1] in self.stop_ids or len(row.tokens) >= row.budget)

        for slot in range(self.slots):
            admit(slot)
        while True:
            for slot in range(self.slots):
                while (row := rows[slot]) is not None and done(row):
                    yield row.key, row.tokens
                    admit(slot)
            active = [(slot, row) for slot, row in enumerate(rows) if row is not None]
            if not active:
                return
            logits = self.runner.decode({slot: row.next_input() for slot, row in active},
                                        {slot: row.length for slot, row in active})
            for _, row in active:
                row.length += 1
            sampled = sample(logits, params, generator).tolist()  # the one host read
            for slot, row in active:
                if row.length >= len(row.prompt):  # it fed its last prompt token or a sampled one
                    row.tokens.append(sampled[slot])
