"""Per-request sampling settings, validated on construction so bad values fail before any GPU work."""
from __future__ import annotations

from dataclasses import dataclass, field


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
        if not isinstance(self.temperature, (int, float)) or self.temperature != self.temperature:
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < float(self.top_p) <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (0 or -1 disable it), got {self.top_k!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
