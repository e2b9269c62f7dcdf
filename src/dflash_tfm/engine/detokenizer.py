"""Streaming detokenisation with stop strings.

Decodes only a short window of recent ids per token (the prefix/read-offset scheme of TGI and vLLM), so
the cost per token is constant rather than growing with the completion; holds back text that is an
incomplete UTF-8 sequence or could still turn into a stop string (`StopStringMatcher`, linear in the text).
"""
from __future__ import annotations

from dflash_tfm.engine.stop_strings import StopStringMatcher


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = StopStringMatcher(stop)
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # everything decoded so far
        self.emitted = 0  # characters of self.text already returned
        self.stopped_at: int | None = None

    def _decode_new(self) -> str:
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        full = self.tokenizer.decode(self.ids[self.prefix_offset :], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix) :]
        return ""

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add one token -> (text safe to show now, whether a stop string has completed)."""
        self.ids.append(token_id)
        new = self._decode_new()
        self.text += new
        if self.stopped_at is None:
            self.stopped_at = self.stops.feed(new)
        if self.stopped_at is not None:
            return "", True
        safe = len(self.text) - self.stops.hold
        out = self.text[self.emitted : safe] if safe > self.emitted else ""
        self.emitted = max(self.emitted, safe)
        return out, False

    def flush(self) -> str:
        """Text not yet returned at the end: the held-back tail, or what precedes the stop string."""
        end = len(self.text) if self.stopped_at is None else self.stopped_at
        out = self.text[self.emitted : end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return out
