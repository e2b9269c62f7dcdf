"""The drafter's RoPE scaling and optional config fields, as the z-lab reference (transformers' Qwen3Config and
`DFlashDraftModel`) reads them.

* YaRN: the drafter's cos/sin tables equal transformers' `Qwen3RotaryEmbedding` for the published revision's
  YaRN (factor 64 over 4096 positions), and a YaRN drafter's draft equals the reference computed with
  transformers' tables; it loads and every speculative mode decodes greedy-equal with it.
* `input_embedding_scale`, `output_multiplier`, `final_logit_softcapping` (in `dflash_config` or at the top
  level) change the draft exactly as the reference's `_raw_input_embeddings` / `compute_logits` do.
* `use_sliding_window`: false (the Qwen3Config default when absent) leaves `sliding_attention` layers without a
  window, still causal inside the block; without `layer_types`, layers from `max_window_layers` on slide.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash_tfm.config import ModelConfig
from dflash_tfm.engine.decoder_factory import build_decoder
from dflash_tfm.errors import CheckpointError
from dflash_tfm.layers.rotary import RotaryEmbedding
from dflash_tfm.loading.loader import build_model
from dflash_tfm.models.presets import QWEN3_6_27B_DFLASH
from dflash_tfm.models.random_init import init_random_
from dflash_tfm.spec.dflash import load_dflash_drafter
from dflash_tfm.spec.dflash_config import DFlashConfig
from dflash_tfm.spec.fixtures import write_random_dflash_checkpoint
from dflash_tfm.spec.weaver_fixtures import write_random_weaver_checkpoint
from tests import spec_config
from tests.spec.test_dflash import FULL, SW, reference_draft, rel_err
from tests.spec.test_speculative_decoding import TARGETS, decode, greedy_reference, runner_for

YARN = {"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "rope_theta": 1e7}
MAX_LEN = 64


def hf_rope_tables(raw: dict, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, head_dim] of transformers' Qwen3 rotary embedding for the drafter config `raw`."""
    import transformers as tf

    config = tf.Qwen3Config(**{k: v for k, v in raw.items() if k not in ("architectures", "dflash_config")})
    rotary = tf.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding(config)
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions.view(1, -1))
    return cos[0], sin[0]


def test_yarn_tables_match_transformers():
    """The published revision's YaRN over 20k positions (the attention factor, 1 + 0.1 ln 64, is in both)."""
    raw = dict(QWEN3_6_27B_DFLASH, rope_parameters=YARN, max_position_embeddings=262144)
    cfg = DFlashConfig.from_dict(raw)
    assert (cfg.rope.rope_type, cfg.rope.factor, cfg.rope.original_max_position_embeddings) == ("yarn", 64.0, 4096)
    ours = RotaryEmbedding(cfg.head_dim, cfg.head_dim, cfg.rope, 20000)
    positions = torch.tensor([0, 1, 17, 4095, 4096, 9000, 19999])
    cos, sin = hf_rope_tables(raw, positions)
    assert torch.allclose(ours.cos_table[positions], cos, rtol=0, atol=1e-6)
    assert torch.allclose(ours.sin_table[positions], sin, rtol=0, atol=1e-6)
    assert abs(float(ours.cos_table[0, 0]) - (1 + 0.1 * torch.log(torch.tensor(64.0)).item())) < 1e-6


@pytest.fixture(scope="module")
def llama_target():
    cfg = ModelConfig.from_dict(TARGETS["dense"])
    return cfg, init_random_(build_model(cfg, torch.device("cpu"), torch.float32, max_positions=512), seed=3)


def rewrite_config(path: Path, **fields) -> Path:
    raw = json.loads((path / "config.json").read_text())
    dflash = dict(raw["dflash_config"], **fields.pop("dflash_config", {}))
    (path / "config.json").write_text(json.dumps(dict(raw, **fields, dflash_config=dflash)))
    return path


OPTIONAL = {  # the reference's optional fields, at either level
    "yarn": dict(rope_parameters=dict(YARN, original_max_position_embeddings=16), max_position_embeddings=1024),
    "scaled": dict(rope_parameters=dict(YARN, factor=4.0, original_max_position_embeddings=16),
                   max_position_embeddings=1024, input_embedding_scale=1.5,
                   dflash_config={"output_multiplier": 0.2, "final_logit_softcapping": 3.0}),
    "unwindowed": dict(layer_types=[SW, FULL], sliding_window=4, use_sliding_window=False),
}


@pytest.mark.parametrize("case", sorted(OPTIONAL))
@torch.no_grad()
def test_draft_matches_reference_with_transformers_rope(llama_target, tmp_path, case):
    cfg, model = llama_target
    path = write_random_dflash_checkpoint(tmp_path / "d", cfg, num_layers=2, block_size=8, target_layer_ids=[0, 2],
                                          seed=5)
    raw = json.loads(rewrite_config(path, **json.loads(json.dumps(OPTIONAL[case]))).joinpath("config.json").read_text())
    drafter = load_dflash_drafter(path, model, cfg, "cpu", torch.float32, max_len=MAX_LEN)
    if case == "unwindowed":
        assert drafter.config.sliding_window is None and drafter.config.layer_types == [SW, FULL]
    if case == "scaled":
        assert (drafter.config.output_multiplier, drafter.config.final_logit_softcapping) == (0.2, 3.0)
    cos, sin = hf_rope_tables(raw, torch.arange(MAX_LEN))
    D = drafter.config.head_dim

    def rotate(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        c, s = cos[pos][:, None], sin[pos][:, None]
        return x * c + torch.cat([-x[..., D // 2 :], x[..., : D // 2]], -1) * s

    feats = torch.randn(1, 30, drafter.config.num_taps * cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    drafter.append_context(feats, 0)
    logits, hidden = drafter.draft(torch.tensor([7]), 30)
    ref_logits, ref_hidden = reference_draft(load_file(path / "model.safetensors"), drafter.config, model.embed_tokens,
                                             model.lm_head_weight, feats[0], 7, 30, rotate=rotate)
    assert rel_err(hidden[0], ref_hidden) <= 1e-5 and rel_err(logits[0], ref_logits) <= 1e-5
    if case == "scaled":
        assert float(logits.abs().max()) <= 3.0


@pytest.mark.parametrize("algo, budget", [("DFLASH", 1), ("DDTREE", 16), ("DFLASH_TFM", 16)])
def test_yarn_drafter_decodes_greedy_equal(llama_target, tmp_path, algo, budget):
    cfg, model = llama_target
    root = tmp_path
    write_random_dflash_checkpoint(root / "dflash", cfg, num_layers=1, block_size=16, target_layer_ids=[0, 2])
    rewrite_config(root / "dflash", **json.loads(json.dumps(OPTIONAL["scaled"])))
    write_random_weaver_checkpoint(root / "weaver.pth", cfg, variant=1)
    decoder = build_decoder(runner_for(model), cfg, spec_config(algo, root, budget))
    assert decoder.drafter.config.rope.rope_type == "yarn"
    assert decode(decoder)[0] == greedy_reference(model)


def test_sliding_window_follows_qwen3_config():
    base = {k: v for k, v in QWEN3_6_27B_DFLASH.items() if k not in ("use_sliding_window", "layer_types")}
    assert DFlashConfig.from_dict(dict(QWEN3_6_27B_DFLASH)).sliding_window == 2048
    absent = DFlashConfig.from_dict(dict(base, layer_types=[SW] * 5))
    assert absent.sliding_window is None and absent.layer_types == [SW] * 5  # Qwen3Config's default: off
    derived = DFlashConfig.from_dict(dict(base, use_sliding_window=True, max_window_layers=3))
    assert derived.layer_types == [FULL, FULL, FULL, SW, SW] and derived.sliding_window == 2048
    assert DFlashConfig.from_dict(base).layer_types == [FULL] * 5
    with pytest.raises(CheckpointError, match="use_sliding_window"):
        DFlashConfig.from_dict(dict(base, use_sliding_window=True, sliding_window=0))
    with pytest.raises(CheckpointError, match="partial_rotary_factor"):
        DFlashConfig.from_dict(dict(base, rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}))
    with pytest.raises(CheckpointError, match="longrope"):
        DFlashConfig.from_dict(dict(base, rope_parameters={"rope_type": "longrope"}))
