"""One request's state while it decodes, and its stop conditions.

Why one class: `Engine.stream` (one request) and continuous batching (many) must end a request at exactly the
same token for the same reason, so both push every produced token through `Sequence.push`, which applies the
stop token ids, the stop strings (through the streaming detokenizer) and the token budget, and turns the token
into the `StreamDelta` the caller yields.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dflash_tfm.engine.detokenizer import IncrementalDetokenizer
from dflash_tfm.engine.result import GenerationStats
from dflash_tfm.sampling_params import SamplingParams


@dataclass
class StreamDelta:
    """Incremental output: new token ids and new text since the last delta; `finish_reason` on the last one."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stats: GenerationStats = field(default_factory=GenerationStats)


@dataclass(eq=False)
class Sequence:
    """A validated request: prompt ids, sampling settings with their own generator, and what it produced.

    `budget` is the most new tokens it may produce (max_new_tokens, cut at the end of the context); `stop_ids`
    the token ids that end it (EOS unless ignore_eos, plus the request's stop_token_ids). Continuous batching
    also keeps its cache row (`slot`), the tokens in that row (`length`) and the last sampled token, which is
    not in the cache yet (`last_token`)."""

    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: set[int]
    budget: int
    generator: torch.Generator | None
    detokenizer: IncrementalDetokenizer
    stats: GenerationStats
    slot: int = -1
    length: int = 0
    last_token: int = -1
    finish_reason: str | None = None
    decode_started: float = 0.0  # time.perf_counter() when its first token was produced

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def push(self, token: int) -> StreamDelta:
        """Record one produced token -> the delta to hand out; the last delta carries the finish reason, the
        held-back text and the final timings."""
        if self.finished:
            raise RuntimeError("token pushed into a finished sequence")
        stats = self.stats
        stats.completion_tokens += 1
        self.last_token = token
        text, stopped_by_string = self.detokenizer.push(token)
        if token in self.stop_ids or stopped_by_string:
            self.finish_reason = "stop"
        elif stats.completion_tokens >= self.budget:
            self.finish_reason = "length"
        if self.finished:
            stats.decode_seconds = time.perf_counter() - self.decode_started
            text += self.detokenizer.flush()
        return StreamDelta([token], text, self.finish_reason, stats)
