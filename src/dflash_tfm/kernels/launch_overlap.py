"""Device-side halves of programmatic dependent launch (PDL): overlap a kernel's start with its predecessor's end.

Why: a tree round is a chain of ~8 short dependent kernels, each streaming a weight or a few rows; launched
plainly, each one's blocks start only after the previous kernel has drained, so every boundary costs the launch,
the ramp-up and (for the projections) the first weight bytes' latency. Launched with ``launch_pdl=True``
(host side: ``kernels.use_pdl``), a kernel may start while its predecessor runs; it first asks L2 for what
does not depend on the predecessor (its weights), then waits for it.

Ordering contract of the kernels that use these: :func:`await_predecessor` comes before any load of data a
previous kernel may write and before any store, and it lets the next kernel launch only after this one's wait,
so at most two kernels of a chain overlap and the earlier one has passed its own wait (completion is transitive).
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def await_predecessor(PDL: tl.constexpr):
    """With PDL: wait until the previous kernel on the stream has finished and its writes are visible, then allow
    the next one to launch. Without: nothing (plain stream order already holds)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def prefetch_rows_l2(w, rows, n_rows, row_stride, k_lo, k_hi, LINE: tl.constexpr, LINES: tl.constexpr):
    """Ask L2 for columns k_lo … k_hi − 1 of rows ``rows`` (clamped to n_rows − 1) of the row-major matrix ``w``:
    one request per LINE elements (a 128-byte line), LINES lines of every row per pass. Fire and forget: a
    prefetch writes nothing, so the clamped rows and columns may name a line twice."""
    base = tl.minimum(rows, n_rows - 1).to(tl.int64) * row_stride
    for k0 in range(k_lo, k_hi, LINE * LINES):
        cols = tl.minimum(k0 + tl.arange(0, LINES) * LINE, k_hi - 1)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [w + base[:, None] + cols[None, :]],
                                  dtype=tl.int32, is_pure=False, pack=1)
