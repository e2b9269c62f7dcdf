"""Fusing chains of small element-wise ops with `torch.compile` (inductor) on CUDA.

At batch 1 a decode step is a few large GEMVs plus thousands of tiny element-wise kernels (norm statistics,
casts, gates, l2norm, ...); inside a CUDA graph each still costs ~2 us, milliseconds per step in total.
Compiling each pure-tensor helper fuses its chain into one or two kernels. The helpers take tensors and
plain numbers only (no modules), so every layer shares one compiled artifact. On the CPU, or with
DFLASH_TFM_COMPILE=0, the same functions run eagerly: one definition, two speeds.
"""
from __future__ import annotations

import functools
import os
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterator, TypeVar

import torch

F = TypeVar("F", bound=Callable)


def enabled() -> bool:
    return os.environ.get("DFLASH_TFM_COMPILE", "1") != "0"


# Fusion pays off where launches dominate: decode (1 token) and tree verify (<= a few hundred nodes), whose
# shapes are few and replayed from CUDA graphs. Counted in tokens (batch x sequence, the first two dims), not
# rows: a 65-node tree's per-head q [1, 65, 24, 256] is 1560 rows but one small verify.
MAX_FUSED_TOKENS = 512
_unfused: ContextVar[bool] = ContextVar("unfused", default=False)  # inside `unfused()` (per thread)


@contextmanager
def unfused() -> Iterator[None]:
    """Run every helper eagerly inside this block: for prompt prefill, whose length changes with every request.
    Compiled, new lengths recompiled (1.5 s for the second length SmolLM2 saw on an H100, 1.2 s for a 333-token
    prompt later); a repeated 30-token SmolLM2 prefill took 55 ms compiled and 25 ms eagerly (an ad-hoc H100
    probe, docs/PERFORMANCE.md "Prompt prefill")."""
    token = _unfused.set(True)
    try:
        yield
    finally:
        _unfused.reset(token)


def small_enough_to_fuse(x: torch.Tensor, count_rows: bool = False) -> bool:
    """At most MAX_FUSED_TOKENS tokens: the product of x's first two dims ([B, T, ...], or [W] slots), or with
    `count_rows` its rows (every dim but the last: a [rows, features] matrix)."""
    tokens = x.shape[:-1].numel() if count_rows else x.shape[:2].numel()
    return tokens <= MAX_FUSED_TOKENS


# One process sees a handful of variants per helper (decode, a few tree sizes, dtypes, inference mode or
# not); past this many, dynamo stops compiling that helper and runs it eagerly instead of failing.
RECOMPILE_LIMIT = 32


def fuse_on_cuda(fn: F, count_rows: bool = False) -> F:
    """Run `fn` compiled (lazily, on first use) when its first tensor argument is a CUDA tensor
    `small_enough_to_fuse` (`count_rows`: see there). Not `fullgraph`: should dynamo ever give up on a
    call (recompile limit, an unsupported op), that call runs eagerly rather than raising."""
    compiled: Callable | None = None

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        nonlocal compiled
        x = args[0]
        if x.is_cuda and enabled() and not _unfused.get() and small_enough_to_fuse(x, count_rows):
            if compiled is None:
                torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
                compiled = torch.compile(fn)
            return compiled(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
