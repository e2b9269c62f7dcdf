"""How a config splits across ranks: the rank's head counts and widths, and the refusals that name the field a
--tp-size does not divide."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dflash_tfm.config import ModelConfig
from dflash_tfm.loading.loader import build_model
from dflash_tfm.parallel.sharding import Shard, shard_config, vocab_rows

from ..models.tiny_targets import build_hf_model


def config(arch: str) -> ModelConfig:
    return ModelConfig.from_dict(build_hf_model(arch).config.to_dict())


def test_rank_config_divides_heads_and_widths() -> None:
    local = shard_config(config("qwen3_5_moe_text"), Shard(0, 2))
    assert (local.num_heads, local.num_kv_heads) == (2, 1)
    assert (local.linear_num_key_heads, local.linear_num_value_heads) == (1, 3)
    assert (local.moe_intermediate_size, local.shared_expert_intermediate_size) == (16, 24)
    assert local.hidden_size == 64 and local.vocab_size == 160 and local.num_experts == 8


def test_expert_parallel_ranks_hold_whole_experts() -> None:
    """--ep-size: rank r of 2 holds experts 4r .. 4r + 3 at their full width; the shared expert and everything
    else split as without it. A rank count that does not divide the experts is refused naming num_experts."""
    cfg = config("qwen3_5_moe_text")
    ranks = [shard_config(cfg, Shard(r, 2, experts=True)) for r in range(2)]
    assert [local.local_experts for local in ranks] == [(0, 4), (4, 4)]
    assert {(local.moe_intermediate_size, local.shared_expert_intermediate_size) for local in ranks} == {(32, 24)}
    assert shard_config(cfg, Shard(0, 1, experts=True)).local_experts is None
    assert shard_config(config("llama"), Shard(0, 2, experts=True)).local_experts is None  # no experts to split
    with pytest.raises(ValueError, match="num_experts"):
        shard_config(replace(cfg, num_experts=7), Shard(0, 2, experts=True))


def test_fewer_kv_heads_than_ranks_are_replicated() -> None:
    """4 query heads and 2 KV heads over 4 ranks: ranks 0, 1 read KV head 0, ranks 2, 3 KV head 1."""
    assert shard_config(config("llama"), Shard(0, 4)).num_kv_heads == 1
    assert [Shard(r, 4).kv_block(2, 16) for r in range(4)] == [(0, 16), (0, 16), (16, 16), (16, 16)]


@pytest.mark.parametrize("arch, tp, field", [
    ("llama", 3, "num_attention_heads"), ("qwen3_5_text", 4, "linear_num_key_heads"),
    ("llama", 8, "num_attention_heads"), ("qwen3_5_moe_text", 0, "at least 1")])
def test_a_size_that_does_not_divide_is_refused_naming_the_field(arch: str, tp: int, field: str) -> None:
    with pytest.raises(ValueError, match=field) as err:
        shard_config(config(arch), Shard(0, tp))
    assert "--tp-size" in str(err.value)


@pytest.mark.parametrize("arch, tp", [("llama", 4), ("qwen3_5_text", 2)])
def test_embedding_and_lm_head_split_by_vocabulary_rows_where_tp_divides_it(arch: str, tp: int) -> None:
    """A rank holds V / tp rows of each (tied or not); a vocabulary tp does not divide stays whole on every rank."""
    cfg = config(arch)
    model = build_model(cfg, torch.device("cpu"), torch.float32, 64, Shard(0, tp))
    assert model.embed_tokens.shape == (cfg.vocab_size // tp, cfg.hidden_size)
    assert model.lm_head_weight.shape == model.embed_tokens.shape and model.config.vocab_size == cfg.vocab_size
    assert vocab_rows(160, 4) == 40 and vocab_rows(161, 2) == 161 and vocab_rows(160, 1) == 160
