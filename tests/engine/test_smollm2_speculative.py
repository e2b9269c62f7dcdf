"""Speculative modes on the real embedded target (SmolLM2-135M-Instruct) with random drafters and Weavers in
the published formats: greedy output equals plain greedy decoding token for token, through `Engine`."""
from __future__ import annotations

import pytest

from dflash_tfm import Engine, SamplingParams
from dflash_tfm.engine.decoder_factory import build_decoder
from dflash_tfm.spec.fixtures import write_random_dflash_checkpoint
from dflash_tfm.spec.weaver_fixtures import write_random_weaver_checkpoint
from tests import spec_config

CHAT = [{"role": "user", "content": "List three facts about the moon."}]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def checkpoints(smollm2: Engine, tmp_path_factory):
    root = tmp_path_factory.mktemp("smollm2_spec")
    cfg = smollm2.config
    write_random_dflash_checkpoint(root / "dflash", cfg, num_layers=1, block_size=16, target_layer_ids=[1, 15, 28])
    write_random_weaver_checkpoint(root / "weaver.pth", cfg, variant=1)
    return root


@pytest.mark.parametrize("algo, budget", [("DFLASH", 1), ("DDTREE", 64), ("DFLASH_TFM", 64)])
def test_speculative_greedy_equals_plain_greedy(smollm2: Engine, checkpoints, algo: str, budget: int) -> None:
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    plain = smollm2.generate(CHAT, params)
    ar_decoder = smollm2.decoder
    try:
        smollm2.decoder = build_decoder(smollm2.runner, smollm2.config, spec_config(algo, checkpoints, budget))
        spec = smollm2.generate(CHAT, params)
    finally:
        smollm2.decoder = ar_decoder
    assert spec.token_ids == plain.token_ids and spec.text == plain.text
    assert spec.stats.verify_steps <= plain.stats.verify_steps
    assert spec.stats.verify_seconds > 0 and spec.stats.draft_seconds > 0 and spec.stats.tree_seconds > 0


GSM8K_STYLE = [{"role": "user", "content": "Tom has 3 boxes with 12 apples each. He gives away 10 apples. "
                                           "How many apples does he have left? Explain step by step."}]


@pytest.mark.parametrize("algo", ["DFLASH", "DDTREE", "DFLASH_TFM"])
def test_committed_bundle_is_lossless_and_accepts(smollm2: Engine, algo: str) -> None:
    """The trained bundle in the package (assets/smollm2_bundle), loaded by the same loaders as a user's
    checkpoints: greedy output still equals plain greedy, and more than one token per target forward is
    accepted on a held-out-style math prompt (random drafters and Weavers accept about 1)."""
    from dflash_tfm.loading.default_model import DEFAULT_BUNDLE

    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    plain = smollm2.generate(GSM8K_STYLE, params)
    ar_decoder = smollm2.decoder
    try:
        smollm2.decoder = build_decoder(smollm2.runner, smollm2.config, spec_config(algo, DEFAULT_BUNDLE, 64))
        spec = smollm2.generate(GSM8K_STYLE, params)
    finally:
        smollm2.decoder = ar_decoder
    assert spec.token_ids == plain.token_ids
    assert spec.stats.accept_length > 1.3, spec.stats.accept_length


NEAR_GREEDY = [dict(temperature=1e-37), dict(temperature=1e-40), dict(temperature=1.0, top_p=1e-46),
               dict(temperature=2e-6, top_p=0.5)]


@pytest.mark.parametrize("algo", ["DFLASH", "DDTREE", "DFLASH_TFM"])
def test_extreme_sampling_values_decode_greedily(smollm2: Engine, algo: str) -> None:
    """Temperatures and top-p values too small to compute with are greedy in every mode: the output equals
    plain greedy decoding token for token (before they were, DFLASH_TFM emitted token 0 out of NaN draws).
    The trained bundle accepts long paths, so the acceptance walk is exercised, not just the bonus token."""
    from dflash_tfm.loading.default_model import DEFAULT_BUNDLE

    greedy = smollm2.generate(GSM8K_STYLE, SamplingParams(max_new_tokens=24, ignore_eos=True)).token_ids
    ar_decoder = smollm2.decoder
    try:
        for settings in NEAR_GREEDY:
            params = SamplingParams(max_new_tokens=24, ignore_eos=True, seed=0, **settings)
            assert params.greedy
            assert smollm2.generate(GSM8K_STYLE, params).token_ids == greedy, f"AR {settings}"
        smollm2.decoder = build_decoder(smollm2.runner, smollm2.config, spec_config(algo, DEFAULT_BUNDLE, 64))
        for settings in NEAR_GREEDY:
            params = SamplingParams(max_new_tokens=24, ignore_eos=True, seed=0, **settings)
            assert smollm2.generate(GSM8K_STYLE, params).token_ids == greedy, f"{algo} {settings}"
    finally:
        smollm2.decoder = ar_decoder
