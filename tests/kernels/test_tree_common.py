"""Shared helpers for the tree-kernel tests (no tests here): where Triton runs, error metric, paths.

Running Triton on the CPU. Triton 3.6 decides interpreted vs compiled when ``@triton.jit`` decorates a
function, reading ``TRITON_INTERPRET`` (``triton.knobs.runtime.interpret``). That includes triton's own
jit'd library functions (``tl.zeros``, ``tl.sum``, ``tl.cdiv`` …), decorated when triton is first imported,
so the variable must be set before the first ``import triton`` in the process; setting it later and
reloading our modules is not enough. A shared pytest process cannot promise that, so ``test_triton_*``
tests take the ``triton_device`` fixture: "cuda" on a GPU; "cpu" in a process started with
``TRITON_INTERPRET=1``; otherwise they skip here and ``test_tree_interpreter.py`` reruns them in such a
child process. The fixture also works around triton 3.6's interpreter turning scalar tensors (shape-(1,)
numpy arrays) into loop bounds with ``int(array)``, which numpy ≥ 2.4 rejects.
"""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from dflash_tfm.kernels import TRITON_INTERPRETED


@pytest.fixture(scope="module")
def triton_device() -> Iterator[str]:
    """"cuda" (compiled kernels) when a GPU is present, "cpu" under the interpreter, else skip."""
    if torch.cuda.is_available():
        yield "cuda"
        return
    if not TRITON_INTERPRETED:
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1 from process start: "
                    "run by test_tree_interpreter.py in a child process")
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(interpreter, "_patch_lang_tensor", patch_lang_tensor)
        yield "cpu"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| / max |b|, in float64 on the CPU."""
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def root_path(parents: torch.Tensor, node: int) -> list[int]:
    """Node indices from the root to ``node`` along ``parents [N]``."""
    path = [node]
    while int(parents[path[-1]]) >= 0:
        path.append(int(parents[path[-1]]))
    return path[::-1]


def accepted_mask(parents: torch.Tensor, nodes: list[int]) -> torch.Tensor:
    """``[B, N]`` bool mask of the root→nodes[b] path of every tree in ``parents [B, N]`` (−1: nothing)."""
    mask = torch.zeros(parents.shape, dtype=torch.bool)
    for b, node in enumerate(nodes):
        if node >= 0:
            mask[b, root_path(parents[b], node)] = True
    return mask

