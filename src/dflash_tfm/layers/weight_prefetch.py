"""Warming L2 with the start of the projection that follows a latency-bound phase.

A GDN layer's recurrence (the tree solve in verify, the fused kernel at decode) and an attention layer's
attention leave HBM nearly idle for microseconds to tens of microseconds, and then out_proj / o_proj stream a
weight larger than L2 (63 MB at Qwen3.6-27B). `prefetch_weight`, called by the mixer just before that phase,
asks the copy engine for the weight's first `prefetch_bytes()` (`kernels/linear/l2_prefetch.py`), so the GEMM
reads them from L2. It changes no value, only timing. The byte count is process-wide; 0 turns it off.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from dflash_tfm.kernels.linear.l2_prefetch import l2_prefetch

DEFAULT_PREFETCH_BYTES = 0
_nbytes = DEFAULT_PREFETCH_BYTES


def prefetch_bytes() -> int:
    return _nbytes


@contextmanager
def prefetching(nbytes: int) -> Iterator[None]:
    """Prefetch `nbytes` of each such weight inside this block (CUDA graphs keep what was captured)."""
    global _nbytes
    if nbytes < 0:
        raise ValueError(f"prefetch bytes must be >= 0, got {nbytes}")
    previous, _nbytes = _nbytes, nbytes
    try:
        yield
    finally:
        _nbytes = previous


def prefetch_weight(weight: torch.Tensor) -> None:
    """Ask for the first `prefetch_bytes()` of `weight` in L2 (a no-op when off or off CUDA)."""
    if _nbytes and weight.is_cuda:
        l2_prefetch(weight, _nbytes)
