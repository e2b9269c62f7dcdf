"""Triton kernels for tree verification, each with a pure-PyTorch twin (``reference.py`` / ``tree_reference.py``).

Importing needs neither CUDA nor fla. On a CPU tensor the public functions run their torch twin, unless
Triton's interpreter is on (``TRITON_INTERPRET=1`` set before triton was first imported in the process).
"""
from __future__ import annotations

import torch
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

# Triton picks compiled vs interpreted (TRITON_INTERPRET=1) when @triton.jit decorates a function, and its
# own jit'd library (tl.zeros, tl.sum, …) is decorated at the first `import triton`: the interpreter only
# works when the variable was set before that import, which this detects.
TRITON_INTERPRETED = isinstance(tl.zeros, InterpretedFunction)


def use_triton(x: torch.Tensor) -> bool:
    """Whether to launch the Triton kernel for tensors on ``x``'s device: CUDA, or anything under the
    interpreter (else the torch twin runs). Defined before the submodule imports below, which use it."""
    return x.is_cuda or TRITON_INTERPRETED


from dflash_tfm.kernels.attention.tree_attention import compact_accepted_kv, tree_attention  # noqa: E402
from dflash_tfm.kernels.conv.tree_conv import tree_causal_conv1d, tree_conv_commit  # noqa: E402
from dflash_tfm.kernels.gdn.tree_commit import gdn_tree_commit  # noqa: E402
from dflash_tfm.kernels.gdn.tree_verify import gdn_tree_verify  # noqa: E402

__all__ = [
    "compact_accepted_kv",
    "gdn_tree_commit",
    "gdn_tree_verify",
    "tree_attention",
    "tree_causal_conv1d",
    "tree_conv_commit",
    "use_triton",
    "TRITON_INTERPRETED",
]
