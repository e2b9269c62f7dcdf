"""Runs every ``test_triton_*`` tree-kernel test under Triton's CPU interpreter, in one child pytest process
started with ``TRITON_INTERPRET=1`` (why a child process: see test_tree_common.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_tfm.kernels import TRITON_INTERPRETED

MODULES = ("test_tree_gdn.py", "test_tree_conv.py", "test_gdn_tree_inputs.py", "test_tree_attention.py", "test_skinny_matmul.py", "test_fused_gemv.py", "test_add_rms_norm.py",
           "test_tree_growth.py", "test_weaver_step.py", "test_linear_cross_entropy.py", "test_moe_experts.py",
           "test_fp8_matmul.py")


@pytest.mark.skipif(torch.cuda.is_available() or TRITON_INTERPRETED, reason="Triton tests run in this process")
def test_interpreted_kernels_in_child_process() -> None:
    here = Path(__file__).parent
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}  # the interpreter is Python-bound
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "triton",
           *(str(here / m) for m in MODULES)]
    proc = subprocess.run(cmd, env=env, cwd=here.parents[1], capture_output=True, text=True)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in summary and "skipped" not in summary, summary
