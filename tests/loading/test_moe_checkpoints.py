"""Mixture-of-experts checkpoints: both expert layouts load to the same model, and bad expert tensors or MoE
configs fail early with the key and both shapes named.

Layouts: one tensor per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`, what transformers saves and
Qwen3-Next was released in) and fused stacks (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`
[E, H, I], the Qwen3.5-MoE release); transformers reading our fused copies back is the check that the fused
layout is its own.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash_tfm.config import ModelConfig
from dflash_tfm.errors import CheckpointError
from dflash_tfm.loading.loader import load_target

from ..models.tiny_targets import VOCAB, fuse_experts, hf_logits, save_hf_model
from .checkpoint_edits import check, copy_checkpoint, edit_weights

ARCHS = {"qwen3_5_moe": "model.language_model.", "qwen3_next_moe": "model."}  # arch -> weight prefix


@pytest.fixture(scope="module", params=sorted(ARCHS))
def layouts(request, tmp_path_factory) -> tuple[str, object, Path, Path]:
    """(arch, transformers model, per-expert directory, fused directory)."""
    root = tmp_path_factory.mktemp("moe")
    hf_model, per_expert = save_hf_model(request.param, root)
    return request.param, hf_model, per_expert, fuse_experts(per_expert, root / "fused")


def _load(path: Path) -> torch.nn.Module:
    return load_target(path, torch.device("cpu"), torch.float32, progress=False).model


def test_both_layouts_load_the_same_model(layouts) -> None:
    arch, hf_model, per_expert, fused = layouts
    names = load_file(fused / "model.safetensors").keys()
    assert not any(".experts.0." in n for n in names) and any(n.endswith("experts.gate_up_proj") for n in names)
    for (name, a), (_, b) in zip(_load(per_expert).named_parameters(), _load(fused).named_parameters()):
        assert torch.equal(a, b), name
    import transformers as tf

    hf_class = tf.Qwen3_5MoeForConditionalGeneration if arch == "qwen3_5_moe" else tf.Qwen3NextForCausalLM
    ids = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(4))
    reread = hf_logits(hf_class.from_pretrained(fused).float().eval(), ids)
    assert torch.allclose(reread, hf_logits(hf_model, ids), atol=1e-5)


def test_mis_shaped_per_expert_tensor_names_key_and_both_shapes(layouts, tmp_path: Path) -> None:
    arch, _, per_expert, _ = layouts
    key = f"{ARCHS[arch]}layers.2.mlp.experts.5.up_proj.weight"
    path = edit_weights(copy_checkpoint(per_expert, tmp_path / "m"), lambda t: t.__setitem__(key, torch.zeros(30, 64)))
    with pytest.raises(CheckpointError, match=rf"'{key}': expected shape \[32, 64\], found \[30, 64\]"):
        check(path)


def test_mis_shaped_fused_tensor_names_key_and_both_shapes(layouts, tmp_path: Path) -> None:
    arch, _, _, fused = layouts
    key = f"{ARCHS[arch]}layers.0.mlp.experts.down_proj"
    path = edit_weights(copy_checkpoint(fused, tmp_path / "m"), lambda t: t.__setitem__(key, torch.zeros(8, 64, 30)))
    with pytest.raises(CheckpointError, match=rf"'{key}': expected shape \[8, 64, 32\], found \[8, 64, 30\]"):
        check(path)


def test_missing_expert_is_named(layouts, tmp_path: Path) -> None:
    arch, _, per_expert, _ = layouts
    key = f"{ARCHS[arch]}layers.3.mlp.experts.7.down_proj.weight"
    path = edit_weights(copy_checkpoint(per_expert, tmp_path / "m"), lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match=rf"missing tensor '{key}' \(expected shape \[64, 32\]\)"):
        check(path)


def test_a_layer_mixing_the_layouts_is_refused(layouts, tmp_path: Path) -> None:
    """Fused gate_up next to per-expert down projections: the fused down stack is missing, the others unexpected."""
    arch, _, per_expert, fused = layouts
    layer = f"{ARCHS[arch]}layers.0.mlp.experts."
    gate_up = load_file(fused / "model.safetensors")[layer + "gate_up_proj"]

    def half_fuse(tensors: dict) -> None:
        for e in range(8):
            del tensors[f"{layer}{e}.gate_proj.weight"], tensors[f"{layer}{e}.up_proj.weight"]
        tensors[layer + "gate_up_proj"] = gate_up

    path = edit_weights(copy_checkpoint(per_expert, tmp_path / "m"), half_fuse)
    with pytest.raises(CheckpointError, match=rf"(?s)unexpected tensor '{layer}0\.down_proj\.weight'.*"
                                              rf"missing tensor '{layer}down_proj' \(expected shape \[8, 64, 32\]\)"):
        check(path)


def test_expert_count_that_does_not_fit_the_weights(layouts, tmp_path: Path) -> None:
    arch, _, per_expert, _ = layouts
    path = copy_checkpoint(per_expert, tmp_path / "m")
    raw = json.loads((path / "config.json").read_text())
    (raw.get("text_config") or raw)["num_experts"] = 16
    (path / "config.json").write_text(json.dumps(raw))
    router = rf"'{ARCHS[arch]}layers\.0\.mlp\.gate\.weight'"
    with pytest.raises(CheckpointError, match=rf"{router}: expected shape \[16, 64\], found \[8, 64\]"):
        check(path)


MOE_TEXT = dict(model_type="qwen3_5_moe_text", hidden_size=64, num_hidden_layers=4, vocab_size=VOCAB,
                num_attention_heads=4, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                shared_expert_intermediate_size=32)
NEXT = dict(MOE_TEXT, model_type="qwen3_next", intermediate_size=96)


@pytest.mark.parametrize("raw, layers", [
    (MOE_TEXT, [0, 1, 2, 3]),                                           # every Qwen3.5-MoE layer
    ({**NEXT, "decoder_sparse_step": 2}, [1, 3]),                       # (i + 1) % step == 0
    ({**NEXT, "decoder_sparse_step": 2, "mlp_only_layers": [3]}, [1]),  # minus the dense-only layers
    ({**NEXT, "mlp_only_layers": [0, 1, 2, 3]}, []),                    # all dense: no expert fields needed
    ({**NEXT, "num_experts": 0}, []),
])
def test_sparse_layers_follow_transformers(raw: dict, layers: list[int]) -> None:
    assert ModelConfig.from_dict(raw).moe_layers == layers


@pytest.mark.parametrize("raw, message", [
    ({k: v for k, v in MOE_TEXT.items() if k != "num_experts_per_tok"},
     r"mixture-of-experts config is missing required field 'num_experts_per_tok'"),
    ({**MOE_TEXT, "num_experts_per_tok": 9}, r"num_experts_per_tok \(9\) must be in \[1, num_experts = 8\]"),
    ({**{k: v for k, v in NEXT.items() if k != "intermediate_size"}, "mlp_only_layers": [1]},  # a dense layer
     r"missing required field 'intermediate_size'"),
])
def test_bad_moe_configs_are_refused(raw: dict, message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        ModelConfig.from_dict(raw)
