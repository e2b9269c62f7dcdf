"""Which training rows are held out for validation.

A row's side follows a hash of its id, not a shuffle of the whole data set: when data is added or a run
continues from an earlier model (`--init-from`), rows the earlier run trained on stay out of validation, so
the validation numbers of a continued run are still held-out numbers. Extra samples of one prompt (row ids
``key#suffix``, `gen-data --id-suffix`) are hashed by the prompt's key, so they all fall on the same side.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import TypeVar

R = TypeVar("R")
SAMPLE_SEPARATOR = "#"  # row id = prompt key [+ "#" + which extra sample]


def hash_fraction(key: str) -> float:
    """A uniform number in [0, 1) fixed by `key` (the same on every machine and run)."""
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest(), "big") / 2.0**64


def split_validation(rows: Sequence[R], key: Callable[[R], str], val_frac: float) -> tuple[list[R], list[R]]:
    """(validation rows, training rows): the rows whose prompt's `hash_fraction` is below `val_frac`, kept
    between 1 and len(rows) - 1 of them (the lowest hashes) so both sides are non-empty; ([], rows) when
    `val_frac` <= 0 or there are fewer than 2 rows. Training rows keep their order."""
    if val_frac <= 0 or len(rows) < 2:
        return [], list(rows)
    fractions = [hash_fraction(key(r).split(SAMPLE_SEPARATOR)[0]) for r in rows]
    by_hash = sorted(range(len(rows)), key=fractions.__getitem__)
    n_val = min(max(1, sum(f < val_frac for f in fractions)), len(rows) - 1)
    held_out = set(by_hash[:n_val])
    return [rows[i] for i in by_hash[:n_val]], [r for i, r in enumerate(rows) if i not in held_out]
