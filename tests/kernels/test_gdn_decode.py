"""The Triton GDN decode kernel equals the recurrent reference (Triton CPU interpreter here, real sizes on GPU).

Triton 3.6's interpreter needs ``TRITON_INTERPRET=1`` before triton is first imported, which a shared pytest
process cannot promise, so the interpreted kernel runs in a child process (this file run as a script) that
saves its outputs; the tests compare them with the reference computed here.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_tfm.kernels.gdn import decode
from dflash_tfm.kernels.gdn.reference import gdn_recurrent_reference, make_gdn_inputs

# name: (dtype, B, T, HK, HV, dk, dv, block_v, packed). Two or more dv blocks per head, grouped values
# (r = 3), dk/dv that are not powers of two (masked tiles), and q/k/v as strided views of one packed
# projection like the model makes them (with the default, freshly allocated output).
CASES = {
    "fp32_T1": (torch.float32, 1, 1, 2, 6, 16, 32, 16, False),
    "fp32_T3": (torch.float32, 1, 3, 2, 6, 16, 32, 16, False),
    "bf16_T1": (torch.bfloat16, 1, 1, 2, 6, 16, 32, 16, False),
    "bf16_T3": (torch.bfloat16, 1, 3, 2, 6, 16, 32, 16, False),
    "fp32_T2_packed_odd_dims": (torch.float32, 2, 2, 1, 3, 24, 24, 16, True),
}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return ((a - b).norm() / b.norm()).item()


def case_inputs(name: str) -> dict[str, torch.Tensor]:
    """Deterministic inputs for a case (identical in this process and in the interpreter child)."""
    dtype, B, T, HK, HV, dk, dv, _, packed = CASES[name]
    x = make_gdn_inputs(B, T, HK, HV, dk, dv, dtype=dtype, seed=len(name))
    if packed:
        mixed = torch.cat([x["q"].flatten(2), x["k"].flatten(2), x["v"].flatten(2)], dim=-1)
        q, k, v = mixed.split([HK * dk, HK * dk, HV * dv], dim=-1)
        x.update(q=q.view(B, T, HK, dk), k=k.view(B, T, HK, dk), v=v.view(B, T, HV, dv))
        assert not x["v"].is_contiguous()
    return x


def run_decode(name: str) -> dict[str, torch.Tensor | bool]:
    """Run gdn_decode on a case; outputs are poisoned with NaN first to prove every element is written."""
    *_, block_v, packed = CASES[name]
    x = case_inputs(name)
    before = {key: t.clone() for key, t in x.items()}
    state = x["initial_state"].clone()
    out = None if packed else torch.full_like(x["v"], float("nan"))
    o = decode.gdn_decode(x["q"], x["k"], x["v"], x["g"], x["beta"], state, out=out, block_v=block_v)
    unchanged = all(torch.equal(x[key], before[key]) for key in x)
    return {"o": o, "state": state, "inputs_unchanged": unchanged, "same_out": out is None or o is out}


def check(name: str, result: dict[str, torch.Tensor | bool]) -> None:
    dtype = CASES[name][0]
    o_ref, s_ref = gdn_recurrent_reference(**case_inputs(name))
    o, state = result["o"], result["state"]
    assert result["inputs_unchanged"] and result["same_out"]
    assert o.dtype == dtype and o.shape == o_ref.shape and not o.isnan().any()
    assert rel_err(o, o_ref) <= (1e-5 if dtype == torch.float32 else 1e-2)
    assert rel_err(state, s_ref) <= 1e-5


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    path = tmp_path_factory.mktemp("gdn_decode") / "results.pt"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, __file__, str(path)], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(path)


@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_kernel_matches_reference(name: str, interpreted: dict[str, dict]) -> None:
    assert interpreted["interpret"], "the child process did not run Triton's interpreter"
    check(name, interpreted[name])


@pytest.mark.parametrize("name", ["fp32_T3", "bf16_T1", "fp32_T2_packed_odd_dims"])
def test_cpu_fallback_matches_reference(name: str) -> None:
    check(name, run_decode(name))


def cpu_reference(x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference on CPU: plain fp32, whatever TF32 setting the process has for CUDA matmuls."""
    return gdn_recurrent_reference(**{key: t.cpu() for key, t in x.items()})


def gpu_inputs(T: int) -> dict[str, torch.Tensor]:
    """Qwen3.6-27B GDN shapes: 16 q/k heads, 48 value heads, dk = dv = 128, bf16 q/k/v, fp32 g/beta/state."""
    return make_gdn_inputs(1, T, 16, 48, 128, 128, dtype=torch.bfloat16, device="cuda", seed=T)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 3])
def test_gpu_decode_matches_reference_27b_shape(T: int) -> None:
    x = gpu_inputs(T)
    before = {key: t.clone() for key, t in x.items()}
    state = x["initial_state"].clone()
    out = torch.full_like(x["v"], float("nan"))
    decode.gdn_decode(x["q"], x["k"], x["v"], x["g"], x["beta"], state, out=out)
    o_ref, s_ref = cpu_reference(x)
    assert all(torch.equal(x[key], before[key]) for key in x)
    assert not out.isnan().any()
    assert rel_err(out, o_ref) <= 1e-2
    assert rel_err(state, s_ref) <= 1e-4


@pytest.mark.gpu
def test_gpu_decode_cuda_graph_replay() -> None:
    """Captured once, replayed twice: the state advances two steps in place, the output is the second step's."""
    x = gpu_inputs(1)
    q, k, v, g, beta = (x[key] for key in ("q", "k", "v", "g", "beta"))
    state = x["initial_state"].clone()
    out = torch.empty_like(v)
    decode.gdn_decode(q, k, v, g, beta, state.clone(), out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode.gdn_decode(q, k, v, g, beta, state, out=out)
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    _, s1 = cpu_reference(x)
    o2, s2 = cpu_reference({**x, "initial_state": s1})
    assert rel_err(out, o2) <= 1e-2
    assert rel_err(state, s2) <= 1e-4


if __name__ == "__main__":  # interpreter child: python test_gdn_decode.py RESULTS_PATH (TRITON_INTERPRET=1)
    results: dict = {"interpret": decode._INTERPRET}
    results.update({name: run_decode(name) for name in CASES})
    torch.save(results, Path(sys.argv[1]))
