"""Warming L2 with part of the next projection's weight while the GPU does latency-bound work.

A decode or tree-verify step alternates projections that stream a weight larger than L2 with phases that
leave HBM nearly idle: a mixer's recurrence or attention ("mixer" windows: microseconds at decode, tens of
them in a tree verify) and, between two projections, a norm or silu · mul of a few rows ("short" windows: a
few µs with the kernel boundaries). `ahead_of(weight, window, x)` wraps such a phase: it forks a side stream
that asks the copy engine for part of the weight (`kernels/linear/l2_prefetch.py`: its first bytes, the start
of every row, or pieces spread over all of it) once the work enqueued before it (the previous projection,
whose own streaming would evict them) is done, and joins it back when the phase ends, just before the
projection. Nothing waits for the data, and no value changes; inside a CUDA graph the fork and join are edges.
The bytes and layout per window kind are process-wide; 0 bytes turn a kind off.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from dflash_tfm.kernels.linear.l2_prefetch import LAYOUTS, l2_prefetch

WINDOWS = ("mixer", "short")
MAX_ROWS = 128  # phases of more rows (prefill chunks) are compute-bound GEMMs' neighbours: nothing to hide
DEFAULT_BYTES = {"mixer": 0, "short": 0}  # off until timed on the GPU (docs/PERFORMANCE.md, issue 3)
DEFAULT_LAYOUTS = {"mixer": "prefix", "short": "prefix"}
_bytes = dict(DEFAULT_BYTES)
_layouts = dict(DEFAULT_LAYOUTS)
_side_streams: dict[int, torch.cuda.Stream] = {}


def prefetch_bytes() -> dict[str, int]:
    """Bytes prefetched per window kind."""
    return dict(_bytes)


def prefetch_layouts() -> dict[str, str]:
    """The `l2_prefetch` layout per window kind."""
    return dict(_layouts)


@contextmanager
def prefetching(
    mixer: int | None = None, short: int | None = None, mixer_layout: str | None = None,
    short_layout: str | None = None,
) -> Iterator[None]:
    """Prefetch this many bytes, in this layout, in each kind of window inside this block (None keeps the
    current setting); graphs captured inside keep what they captured."""
    new = {name: _bytes[name] if n is None else n for name, n in zip(WINDOWS, (mixer, short))}
    if min(new.values()) < 0:
        raise ValueError(f"prefetch bytes must be >= 0, got {new}")
    chosen = (mixer_layout, short_layout)
    layouts = {name: _layouts[name] if lay is None else lay for name, lay in zip(WINDOWS, chosen)}
    if not set(layouts.values()) <= set(LAYOUTS):
        raise ValueError(f"prefetch layouts must be in {LAYOUTS}, got {layouts}")
    previous = dict(_bytes), dict(_layouts)
    _bytes.update(new)
    _layouts.update(layouts)
    try:
        yield
    finally:
        _bytes.update(previous[0])
        _layouts.update(previous[1])


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _side_streams:
        _side_streams[index] = torch.cuda.Stream(device=index)
    return _side_streams[index]


@contextmanager
def ahead_of(weight: torch.Tensor, window: str, x: torch.Tensor) -> Iterator[None]:
    """Run the block (a phase of the rows of ``x`` before ``linear(…, weight)``) while the start of ``weight``
    is brought into L2. A plain block when the window kind is off, off CUDA, or for more than MAX_ROWS rows."""
    nbytes = _bytes[window]
    if not (nbytes and weight.is_cuda and x.numel() // x.shape[-1] <= MAX_ROWS):
        yield
        return
    main, side = torch.cuda.current_stream(weight.device), _side_stream(weight.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        l2_prefetch(weight, nbytes, _layouts[window])
    try:
        yield
    finally:
        main.wait_stream(side)
