"""The two fp32 GDN twins agree with each other, with transformers' torch GDN and (on CUDA) with fla."""
from __future__ import annotations

import inspect

import pytest
import torch

from dflash_tfm.kernels.gdn.prefill import gdn_prefill
from dflash_tfm.kernels.gdn.reference import gdn_chunk_reference, gdn_recurrent_reference, make_gdn_inputs


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return ((a - b).norm() / b.norm()).item()


def snapshot(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: x.clone() for name, x in inputs.items()}


def assert_unchanged(inputs: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> None:
    for name, x in inputs.items():
        assert torch.equal(x, before[name]), f"input {name} was modified"


# (B, T, HK, HV, dk, dv, chunk_size): T not a multiple of the chunk and > 2 chunks, grouped values,
# T < one chunk, an exact multiple without grouping, dk != dv.
CASES = [
    (2, 150, 2, 6, 16, 32, 64),
    (1, 37, 1, 3, 32, 16, 16),
    (1, 5, 2, 6, 16, 16, 64),
    (2, 64, 2, 2, 16, 16, 32),
]


@pytest.mark.parametrize("B,T,HK,HV,dk,dv,chunk", CASES)
def test_chunk_equals_recurrent(B: int, T: int, HK: int, HV: int, dk: int, dv: int, chunk: int) -> None:
    x = make_gdn_inputs(B, T, HK, HV, dk, dv, seed=T)
    before = snapshot(x)
    o_rec, s_rec = gdn_recurrent_reference(**x)
    o_chk, s_chk = gdn_chunk_reference(**x, chunk_size=chunk)
    assert_unchanged(x, before)
    assert o_chk.shape == o_rec.shape == (B, T, HV, dv) and o_chk.dtype == torch.float32
    assert s_chk.shape == s_rec.shape == (B, HV, dk, dv) and s_chk.dtype == torch.float32
    assert rel_err(o_chk, o_rec) <= 1e-5
    assert rel_err(s_chk, s_rec) <= 1e-5


def test_zero_initial_state_and_custom_scale() -> None:
    x = make_gdn_inputs(1, 70, 2, 6, 16, 16, seed=1)
    x["initial_state"] = None
    o_rec, s_rec = gdn_recurrent_reference(**x, scale=0.3)
    o_chk, s_chk = gdn_chunk_reference(**x, scale=0.3, chunk_size=32)
    assert rel_err(o_chk, o_rec) <= 1e-5 and rel_err(s_chk, s_rec) <= 1e-5
    # scale only multiplies q
    x["q"] = x["q"] * (0.3 / 16**-0.5)
    o_def, _ = gdn_recurrent_reference(**x)
    assert rel_err(o_def, o_rec) <= 1e-6


def test_strong_decay_stays_finite() -> None:
    """e^G underflows inside a chunk when g is very negative: the chunk form must not overflow or NaN."""
    x = make_gdn_inputs(1, 100, 2, 6, 16, 16, seed=2)
    x["g"] = x["g"] * 40.0
    o_rec, s_rec = gdn_recurrent_reference(**x)
    o_chk, s_chk = gdn_chunk_reference(**x)
    assert torch.isfinite(o_chk).all() and torch.isfinite(s_chk).all()
    assert rel_err(o_chk, o_rec) <= 1e-5 and rel_err(s_chk, s_rec) <= 1e-5


def test_bf16_inputs_keep_dtype() -> None:
    x = make_gdn_inputs(1, 40, 2, 6, 16, 16, dtype=torch.bfloat16, seed=3)
    o_rec, s_rec = gdn_recurrent_reference(**x)
    o_chk, s_chk = gdn_chunk_reference(**x, chunk_size=16)
    assert o_chk.dtype == o_rec.dtype == torch.bfloat16 and s_chk.dtype == torch.float32
    assert rel_err(o_chk, o_rec) <= 1e-2 and rel_err(s_chk, s_rec) <= 1e-5


def _transformers_gdn() -> tuple:
    """transformers' pure-torch GDN; its decorator would dispatch to fla when fla is installed, so unwrap it."""
    qwen = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    return inspect.unwrap(qwen.torch_recurrent_gated_delta_rule), inspect.unwrap(qwen.torch_chunk_gated_delta_rule)


def test_matches_transformers() -> None:
    hf_recurrent, hf_chunk = _transformers_gdn()
    B, T, HK, HV, dk, dv = 2, 150, 2, 6, 16, 32
    x = make_gdn_inputs(B, T, HK, HV, dk, dv, seed=4)
    # transformers expects q/k already repeated to HV heads and scales q by dk^-0.5 itself.
    r = HV // HK
    hf_args = dict(
        query=x["q"].repeat_interleave(r, dim=2), key=x["k"].repeat_interleave(r, dim=2), value=x["v"],
        g=x["g"], beta=x["beta"], initial_state=x["initial_state"], output_final_state=True,
        use_qk_l2norm_in_kernel=False,
    )
    o_hf_rec, s_hf_rec = hf_recurrent(**hf_args)
    o_hf_chk, s_hf_chk = hf_chunk(**hf_args)
    o_rec, s_rec = gdn_recurrent_reference(**x)
    o_chk, s_chk = gdn_chunk_reference(**x)
    for o_hf, s_hf in ((o_hf_rec, s_hf_rec), (o_hf_chk, s_hf_chk)):
        assert rel_err(o_rec, o_hf) <= 1e-5 and rel_err(s_rec, s_hf) <= 1e-5
        assert rel_err(o_chk, o_hf) <= 1e-5 and rel_err(s_chk, s_hf) <= 1e-5


def test_prefill_cpu_is_chunk_reference() -> None:
    x = make_gdn_inputs(1, 70, 2, 6, 16, 16, seed=5)
    before = snapshot(x)
    o, s = gdn_prefill(**x)
    o_ref, s_ref = gdn_chunk_reference(**x)
    assert_unchanged(x, before)
    assert torch.equal(o, o_ref) and torch.equal(s, s_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [100, 4096])
def test_prefill_fla_matches_reference_27b_shape(T: int) -> None:
    """fla's chunk kernel (bf16 inputs, fp32 state) vs the fp32 chunk reference at Qwen3.6-27B GDN shapes."""
    x = make_gdn_inputs(1, T, 16, 48, 128, 128, dtype=torch.bfloat16, device="cuda", seed=T)
    before = snapshot(x)
    o, s = gdn_prefill(**x)
    o_ref, s_ref = gdn_chunk_reference(**{key: t.cpu() for key, t in x.items()})  # fp32, no TF32
    assert_unchanged(x, before)
    assert o.dtype == torch.bfloat16 and o.shape == o_ref.shape
    assert s.dtype == torch.float32 and s.shape == s_ref.shape
    assert rel_err(o, o_ref) <= 1e-2
    assert rel_err(s, s_ref) <= 1e-2
