"""The feature store gives each row what a target pass over that row alone gives, and training with it or
without it learns the same thing."""
from __future__ import annotations

import pytest
import torch

from dflash_tfm.config import ModelConfig
from dflash_tfm.loading.loader import build_model
from dflash_tfm.models.random_init import init_random_
from dflash_tfm.train.target_features import CPU_STORE_BYTES, FeatureStore, TargetFeatures, store_fits

TARGETS = {
    "llama": dict(model_type="llama", vocab_size=97, hidden_size=32, intermediate_size=48, rms_norm_eps=1e-6,
                  max_position_embeddings=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2),
    "qwen3_5_text": dict(
        model_type="qwen3_5_text", vocab_size=97, hidden_size=32, intermediate_size=48, rms_norm_eps=1e-6,
        max_position_embeddings=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        layer_types=["linear_attention", "full_attention", "linear_attention"], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    ),
}


@pytest.mark.parametrize("arch", sorted(TARGETS))
def test_store_equals_a_pass_over_each_row_alone(arch: str) -> None:
    cfg = ModelConfig.from_dict(TARGETS[arch])
    model = init_random_(build_model(cfg, torch.device("cpu"), torch.float32, 64), seed=1)
    features = TargetFeatures(model, [0, 2], max_len=64)
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (5, 40, 17, 1, 33, 40, 9)]
    store = FeatureStore(features, rows, with_hidden=True, batch_rows=3, progress=False)

    picked = [rows[2], rows[0], rows[5]]
    hidden, feats = store.gather(picked, 20)
    assert hidden is not None and hidden.shape == (3, 20, 32) and feats.shape == (3, 20, 64)
    for i, row in enumerate(picked):
        alone_h, alone_f = features.hidden_and_features(torch.tensor([row]))
        n = min(len(row), 20)
        torch.testing.assert_close(hidden[i, :n], alone_h[0, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(feats[i, :n], alone_f[0, :n], rtol=1e-5, atol=1e-5)
        assert torch.equal(feats[i, n:], feats[i, n - 1].expand(20 - n, -1))  # padding repeats the last position
    assert rows[3] in store and [1, 2, 3] not in store  # identity, not value: a new list is not a stored row
    assert store.gather(rows[:2], 4)[0] is not None
    assert FeatureStore(features, rows[:2], with_hidden=False, progress=False).gather(rows[:2], 4)[0] is None


def test_store_fits_says_when_the_trainer_falls_back_to_a_target_pass_per_step(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A store over the limit returns False and prints why (the trainer is then several times slower)."""
    assert store_fits(1000, 576, torch.bfloat16, torch.device("cpu"))
    assert capsys.readouterr().err == ""
    too_many = CPU_STORE_BYTES // (576 * 2) + 1
    assert not store_fits(too_many, 576, torch.bfloat16, torch.device("cpu"))
    err = capsys.readouterr().err
    assert f"{too_many:,} tokens" in err and "running the target every step" in err
