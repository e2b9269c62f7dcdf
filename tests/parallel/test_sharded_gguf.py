"""A GGUF target (mixed F32 / F16 / Q8_0 / Q4_1 tensors, llama.cpp's q/k permutation) at tensor-parallel size 2
(gloo): each rank dequantizes every tensor and keeps its slice, and the logits equal the tp 1 model's."""
from __future__ import annotations

import numpy as np
import torch

from ..loading.test_gguf import _hf_weights, _qtype, _write_gguf
from .ranks import run_ranks
from .test_sharded_logits import passes, rel_err


def test_gguf_target_at_tp2_matches_tp1(tmp_path) -> None:
    weights = _hf_weights("llama", np.random.default_rng(0))
    path = tmp_path / "tiny-llama.gguf"
    _write_gguf(path, "llama", weights, {name: _qtype(name) for name in weights})
    expected = passes(0, 1, str(path))
    ranks = run_ranks(2, passes, str(path))
    for name, logits in expected.items():
        assert rel_err(ranks[0][name], logits) <= 1e-5, name
        assert torch.equal(ranks[1][name], ranks[0][name]), f"{name}: the ranks disagree"
