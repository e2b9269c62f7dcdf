"""What `Engine.generate` returns: tokens, text and the step statistics users and benchmarks read."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class GenerationStats:
    """Counts and timings of one request.

    verify_steps counts the target forward passes that produced tokens: the prefill (which yields the first
    token) plus one per decode step (one token in AR mode, one tree in speculative modes). So
    accept_length = completion_tokens / verify_steps is tau, exactly 1 for autoregressive decoding.
    draft_tokens counts the tokens proposed for verification (tree nodes below the root, summed over steps) and
    accepted_draft_tokens those of them the target accepted (each step also yields one token of its own);
    draft_sizes counts the decode steps by proposal size (0: a plain decode step), which an adaptive budget
    chooses per step. expected_accepted_draft_tokens, when the decoder tracks it (benchmarks), is what the
    accepted drafts are in expectation under the target, given the trees the request verified.
    """

    prompt_tokens: int = 0
    completion_tokens: int = 0
    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    draft_sizes: dict[int, int] = field(default_factory=dict)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    draft_seconds: float = 0.0
    tree_seconds: float = 0.0
    verify_seconds: float = 0.0
    commit_seconds: float = 0.0
    expected_accepted_draft_tokens: float | None = None

    def count_step(self, drafts: int, produced: int) -> None:
        """One decode step that verified `drafts` proposed tokens (0: a plain decode step) and produced
        `produced` tokens (the accepted drafts and the target's own)."""
        self.verify_steps += 1
        self.draft_tokens += drafts
        self.draft_sizes[drafts] = self.draft_sizes.get(drafts, 0) + 1
        self.accepted_draft_tokens += produced - 1

    @property
    def accept_length(self) -> float:
        return self.completion_tokens / self.verify_steps if self.verify_steps else 0.0

    @property
    def expected_accept_length(self) -> float | None:
        """τ with each step's accepted drafts replaced by their expectation (None when not tracked). Equal to
        `accept_length` in expectation, up to a cut at the token limit or a stop."""
        if self.expected_accepted_draft_tokens is None or not self.verify_steps:
            return None
        return (self.verify_steps + self.expected_accepted_draft_tokens) / self.verify_steps

    @property
    def decode_tokens_per_second(self) -> float:
        return self.completion_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["accept_length"] = self.accept_length
        d["decode_tokens_per_second"] = self.decode_tokens_per_second
        return d


@dataclass
class GenerationResult:
    """token_ids are the completion only (prompt excluded); finish_reason is "stop" or "length"."""

    token_ids: list[int]
    text: str
    finish_reason: str
    stats: GenerationStats = field(default_factory=GenerationStats)
