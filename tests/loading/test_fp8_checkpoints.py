"""FP8 block-quantized targets: tiny random checkpoints written in the released format (real key names,
`weight_scale_inv` per 128 × 128 block, `quantization_config`), against transformers on the same weights
dequantised (the oracle); greedy speculative decoding on an FP8 target; `--quantization fp8` at load; and the
refusals (other methods, wrong scales)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from dflash_tfm.engine.autoregressive import AutoregressiveDecoder
from dflash_tfm.engine.decoder_factory import build_decoder
from dflash_tfm.engine.model_runner import ModelRunner
from dflash_tfm.errors import CheckpointError
from dflash_tfm.kernels.fp8.block_quant import BLOCK
from dflash_tfm.layers.fp8_weight import Fp8Weight
from dflash_tfm.loading.quantization import check_quantization_flag
from dflash_tfm.sampling_params import SamplingParams
from dflash_tfm.spec.fixtures import write_random_dflash_checkpoint
from dflash_tfm.spec.weaver_fixtures import write_random_weaver_checkpoint
from tests import spec_config
from tests.models.tiny_targets import VOCAB, fuse_experts, hf_logits, save_hf_model

from .checkpoint_edits import check, copy_checkpoint, edit_weights, load_cpu, quantize_checkpoint

ARCHS = ["qwen3_5", "qwen3_next_moe", "llama"]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def fp8_holders(model) -> dict[str, Fp8Weight]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Fp8Weight)}


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    runner = ModelRunner(model, max_len=256, device=torch.device("cpu"), use_cuda_graph=False)
    with torch.inference_mode():
        hidden, _ = model(ids.view(1, -1), torch.arange(len(ids)).view(1, -1), runner.cache, kv_len=len(ids))
        return model.logits(hidden[0])


@pytest.fixture(scope="module", params=ARCHS)
def fp8_target(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    hf_model, path = save_hf_model(request.param, root)
    quantize_checkpoint(path, root / "fp8", dequantized=root / "dequantized")
    oracle = type(hf_model).from_pretrained(root / "dequantized", dtype=torch.float32).eval()  # transformers' own
    return request.param, root, oracle


def test_fp8_checkpoint_logits_match_transformers_on_dequantized_weights(fp8_target) -> None:
    arch, root, oracle = fp8_target
    model, cfg = load_cpu(root / "fp8")
    holders = fp8_holders(model)
    assert holders and all(h.weight.dtype == torch.float8_e4m3fn for h in holders.values())
    assert model.embed_tokens.dtype == torch.float32  # embeddings, norms, conv stay in the model dtype
    if arch == "qwen3_next_moe":  # in_proj_ba and the router / shared-expert gate stay exact, in one row range
        gdn = holders["layers.0.mixer.in_proj"]
        assert gdn.dense_rows == (cfg.gdn_conv_dim + cfg.gdn_value_dim, gdn.shape[0])
        assert holders["layers.0.mlp.in_proj"].dense_rows == (0, cfg.num_experts + 1)
    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(1))
    assert rel_err(logits(model, ids), hf_logits(oracle, ids)) <= 1e-4


def test_fused_expert_layout_loads_the_same_fp8_model(tmp_path) -> None:
    """Qwen3.5-MoE's fused expert stacks in FP8 ([E, 2I, H] with scales [E, ⌈2I/128⌉, ⌈H/128⌉]) load to the same
    logits as the same values dequantised and loaded plain."""
    _, path = save_hf_model("qwen3_5_moe_text", tmp_path)
    fused = fuse_experts(path, tmp_path / "fused")
    quantize_checkpoint(fused, tmp_path / "fp8", dequantized=tmp_path / "plain")
    model, _ = load_cpu(tmp_path / "fp8")
    assert fp8_holders(model)["layers.0.mlp.experts_gate_up"].weight.dim() == 3
    plain, _ = load_cpu(tmp_path / "plain")
    ids = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(2))
    assert rel_err(logits(model, ids), logits(plain, ids)) <= 1e-5


def decode(decoder, prompt: list[int], n: int) -> list[int]:
    greedy = SamplingParams(temperature=0.0)
    tokens = [decoder.prefill(prompt, greedy, None)]
    while len(tokens) < n:
        tokens += decoder.step(greedy, None)
    return tokens[:n]


@pytest.mark.parametrize("algo, budget", [("DFLASH", 1), ("DDTREE", 16), ("DFLASH_TFM", 16)])
def test_speculative_decoding_on_an_fp8_target_reproduces_greedy(tmp_path, algo: str, budget: int) -> None:
    _, path = save_hf_model("qwen3_5_text", tmp_path)
    model, cfg = load_cpu(quantize_checkpoint(path, tmp_path / "fp8"))
    write_random_dflash_checkpoint(tmp_path / "dflash", cfg, num_layers=1, block_size=16, target_layer_ids=[0, 3])
    write_random_weaver_checkpoint(tmp_path / "weaver.pth", cfg, variant=1)
    runner = lambda: ModelRunner(model, max_len=256, device=torch.device("cpu"), use_cuda_graph=False)  # noqa: E731
    prompt = [5, 17, 42, 8, 77, 3, 61, 29]
    reference = decode(AutoregressiveDecoder(runner()), prompt, 40)
    assert decode(build_decoder(runner(), cfg, spec_config(algo, tmp_path, budget)), prompt, 40) == reference


def test_online_fp8_equals_loading_the_saved_fp8_checkpoint(tmp_path) -> None:
    """`--quantization fp8` on a plain checkpoint holds exactly what loading its FP8-quantized copy holds, and the
    dequantised weights are within e4m3's rounding of the originals."""
    _, path = save_hf_model("qwen3_next_moe", tmp_path)
    online, _ = load_cpu(path, quantization="fp8")
    saved, _ = load_cpu(quantize_checkpoint(path, tmp_path / "fp8"))
    plain, _ = load_cpu(path)
    a, b = fp8_holders(online), fp8_holders(saved)
    assert a.keys() == b.keys() and a
    for name in a:
        assert a[name].weight.view(torch.uint8).equal(b[name].weight.view(torch.uint8)), name
        assert a[name].scale.equal(b[name].scale) and a[name].dense_rows == b[name].dense_rows, name
        original = plain.get_parameter(name)
        back = a[name].dequantize(torch.float32)
        assert ((back - original).abs() <= original.abs() * 2 ** -4 + a[name].scale.max() * 2 ** -9).all(), name
    assert online.embed_tokens.equal(plain.embed_tokens)


def test_quantization_flag_refuses_other_values() -> None:
    assert check_quantization_flag(None) is None and check_quantization_flag("fp8") == "fp8"
    with pytest.raises(ValueError, match="'int8'.*fp8"):
        check_quantization_flag("int8")


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_refusals")
    _, path = save_hf_model("qwen3_5_text", root)
    return quantize_checkpoint(path, root / "fp8")


def with_config(src, dst, **quantization):
    path = copy_checkpoint(src, dst)
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"] = quantization
    (path / "config.json").write_text(json.dumps(raw))
    return path


@pytest.mark.parametrize("method", ["awq", "gptq", "compressed-tensors", "modelopt", "bitsandbytes", "mxfp4"])
def test_other_quantization_methods_are_refused_by_name(fp8_dir, tmp_path, method: str) -> None:
    path = with_config(fp8_dir, tmp_path / method, quant_method=method, bits=4)
    with pytest.raises(CheckpointError, match=f"quantization method '{method}' is not supported"):
        load_cpu(path)


@pytest.mark.parametrize("field, value, message", [
    ("weight_block_size", [64, 64], "weight_block_size"), ("fmt", "e5m2", "fmt"),
    ("activation_scheme", "static", "activation_scheme"), ("scale_fmt", "ue8m0", "scale_fmt")])
def test_fp8_variants_without_kernels_are_refused(fp8_dir, tmp_path, field, value, message) -> None:
    raw = json.loads((fp8_dir / "config.json").read_text())["quantization_config"]
    path = with_config(fp8_dir, tmp_path / field, **{**raw, field: value})
    with pytest.raises(CheckpointError, match=f"unsupported FP8 checkpoint: {message}"):
        load_cpu(path)


def test_wrong_scale_shape_names_the_key_and_both_shapes(fp8_dir, tmp_path) -> None:
    name = "model.layers.0.linear_attn.in_proj_qkv.weight_scale_inv"
    path = edit_weights(copy_checkpoint(fp8_dir, tmp_path / "c"), lambda t: t.update({name: torch.ones(1, 1)}))
    rows = load_file(fp8_dir / "model.safetensors")[name.removesuffix("_scale_inv")].shape[0]
    with pytest.raises(CheckpointError, match=rf"{name}.*expected shape \[{-(-rows // BLOCK)}, 1\].*found \[1, 1\]"):
        check(path)


def test_scales_without_a_quantization_config_are_refused(fp8_dir, tmp_path) -> None:
    path = copy_checkpoint(fp8_dir, tmp_path / "c")
    raw = json.loads((path / "config.json").read_text())
    del raw["quantization_config"]
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="weight_scale_inv.*declares no quantization_config"):
        check(path)


def test_fp8_weight_without_its_scale_is_refused(fp8_dir, tmp_path) -> None:
    name = "model.layers.3.mlp.down_proj.weight_scale_inv"
    path = edit_weights(copy_checkpoint(fp8_dir, tmp_path / "c"), lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match="down_proj.weight' is stored as F8_E4M3 without"):
        check(path)
