"""Training rows: the target's own responses written by ``dflash-tfm gen-data``, read the same way by both trainers.

One JSON object per line, ``{"id", "source", "prompt_ids", "response_ids"}``. A generator stopped by its time cap
may leave a last line without its newline: that line is ignored. Any other malformed line is an error naming the
file and line, so a corrupt shard is never silently half-read.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass
class TrainRow:
    """One training sequence: prompt + target-generated response token ids (truncated), where the response
    starts, and the data row's id (it decides the validation split, ``validation_split.py``)."""

    tokens: list[int]
    prompt_len: int
    key: str = ""


def read_rows(paths: str | Path | list[str | Path], max_len: int, min_response: int = 1) -> list[TrainRow]:
    """Rows of one or more JSONL files, each cut to ``max_len`` tokens; rows with an empty prompt or fewer than
    ``min_response`` response tokens left after the cut are dropped (the drafter needs 2: an anchor with a label).
    Raises ValueError when no row is usable."""
    rows = []
    for path in [paths] if isinstance(paths, (str, Path)) else paths:
        for n, line in enumerate(Path(path).read_text(encoding="utf-8").split("\n")[:-1], 1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e})") from None
            prompt, response = (raw.get("prompt_ids"), raw.get("response_ids")) if isinstance(raw, dict) else (0, 0)
            if not all(isinstance(x, list) and all(isinstance(t, int) for t in x) for x in (prompt, response)):
                raise ValueError(f"{path}:{n}: expected integer lists 'prompt_ids' and 'response_ids'")
            tokens = (prompt + response)[:max_len]
            if prompt and len(tokens) - len(prompt) >= min_response:
                rows.append(TrainRow(tokens, len(prompt), str(raw.get("id", tokens))))
    if not rows:
        raise ValueError(f"{paths}: no usable rows (need a non-empty prompt and at least {min_response} "
                         f"response token(s) within {max_len} tokens)")
    return rows
