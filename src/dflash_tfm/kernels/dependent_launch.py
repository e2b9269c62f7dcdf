"""Programmatic dependent launch (PDL, sm_90+): a kernel's programs start while the previous kernel finishes.

In a chain of short kernels (the GDN tree solve is three launches of ~10 µs) each launch otherwise waits for
the previous grid to drain before its own programs are scheduled. Launched with ``launch_pdl=True``, a kernel
may begin once every program of the previous kernel has called ``gdc_launch_dependents`` (or exited); it
must call ``gdc_wait`` before it reads anything the previous kernels wrote, and before it writes anything
(the allocator may have handed it memory that a still-running kernel reads). ``wait_then_release`` does
both at the top of a kernel: the wait, then the release of the next kernel in the chain.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from dflash_tfm.kernels import TRITON_INTERPRETED


RELEASE = tl.constexpr(os.environ.get("PDL_RELEASE", "1") == "1")  # EXPERIMENT


@triton.jit
def wait_then_release(PDL: tl.constexpr):
    """With PDL: wait for the previous kernel's writes, then let the next kernel launch. A no-op without."""
    if PDL:
        gdc_wait()
        if RELEASE:
            gdc_launch_dependents()


def can_launch_dependent(x: torch.Tensor) -> bool:
    """PDL needs a CUDA device of compute capability 9.0 or higher (and not Triton's CPU interpreter)."""
    return x.is_cuda and not TRITON_INTERPRETED and torch.cuda.get_device_capability(x.device)[0] >= 9
