"""Per-request sampling settings, validated on construction so bad values fail before any GPU work.

Valid ranges (a value outside them is a ValueError whose message starts with the field's name, which the
server turns into a 400 naming that field):

    temperature     [0, 100]; below SAMPLING_EPS it is greedy (argmax), as in SGLang and vLLM
    top_p           (0, 1];   below SAMPLING_EPS it is greedy (only the most likely token survives)
    top_k           -1 or 0 (off), or >= 1; 1 is greedy
    stop            at most MAX_STOP_STRINGS non-empty strings of at most MAX_STOP_CHARS characters each

Treating tiny temperatures and top-p values as greedy is what keeps sampling numerically safe: dividing
logits by 1e-37 overflows fp32, and a top-p of 1e-46 is zero in fp32, and either would otherwise put NaN
into a draw or into the speculative acceptance walk (where it silently picked token 0).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

SAMPLING_EPS = 1e-5  # temperature or top_p below this decode greedily (vLLM's threshold)
MAX_TEMPERATURE = 100.0  # beyond this the distribution is flat to fp32 precision for any real logits
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024


@dataclass
class SamplingParams:
    """How one request is decoded.

    temperature 0 means greedy. top_p in (0, 1], top_k 0 or -1 means "no top-k".
    `stop` holds stop strings; `stop_token_ids` extra stop ids (the tokenizer's EOS ids are added by the
    engine unless `ignore_eos`). `seed` makes sampling reproducible per request.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field for any value the sampler cannot honour."""
        if not _is_number(self.temperature) or not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (0 or -1 disable it), got {self.top_k!r}")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {_short(self.stop)}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        longest = max((len(s) for s in self.stop), default=0)
        if longest > MAX_STOP_CHARS:
            raise ValueError(f"stop: each stop string may have at most {MAX_STOP_CHARS} characters, got {longest}")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {_short(self.stop_token_ids)}")

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature or top_p below SAMPLING_EPS, or top_k 1."""
        return self.temperature < SAMPLING_EPS or self.top_p < SAMPLING_EPS or self.top_k == 1


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
