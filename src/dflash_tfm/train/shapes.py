"""Padded batch lengths for training: few distinct shapes.

Training batches are right-padded to a length. Kernels whose set-up depends on the shape pay it once per new
one: the cuDNN attention behind SDPA builds an execution plan per shape (~0.1 s on the H200), and a batch
padded to its longest row brings a new length almost every step (it was most of a drafter step's wall clock
in the training-step profile, CHANGELOG.md). Rounding lengths up to a multiple of 64 leaves at most 12 shapes for 768.
"""
from __future__ import annotations

LENGTH_MULTIPLE = 64


def padded_length(longest: int, max_length: int) -> int:
    """`longest` rounded up to a multiple of LENGTH_MULTIPLE, capped at `max_length` (never below `longest`)."""
    return max(longest, min(-(-longest // LENGTH_MULTIPLE) * LENGTH_MULTIPLE, max_length))
