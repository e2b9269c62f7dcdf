"""`dflash-tfm tune`: it refuses to run without a GPU, and the steps it runs to meet every tuned shape (prefill,
decode, each speculative algorithm) run on a tiny target; on the CPU they time and write nothing."""
from __future__ import annotations

import torch

from dflash_tfm import tune, tuning
from dflash_tfm.config import ModelConfig
from dflash_tfm.engine.model_runner import ModelRunner
from dflash_tfm.loading.loader import build_model
from dflash_tfm.models.random_init import init_random_
from dflash_tfm.spec.dflash import load_dflash_drafter
from dflash_tfm.spec.fixtures import write_random_dflash_checkpoint
from dflash_tfm.spec.weaver_fixtures import write_random_weaver_checkpoint

TINY = dict(model_type="qwen3_5_text", vocab_size=96, hidden_size=64, intermediate_size=96, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=512,
            tie_word_embeddings=False, num_hidden_layers=4, full_attention_interval=2, linear_num_key_heads=2,
            linear_num_value_heads=6, linear_key_head_dim=16, linear_value_head_dim=16,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})


def test_tune_needs_a_gpu(capsys) -> None:
    assert tune.main(["--device", "cpu"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_the_tuning_steps_run_every_algorithm(tmp_path, monkeypatch) -> None:
    cfg = ModelConfig.from_dict(TINY)
    model = init_random_(build_model(cfg, torch.device("cpu"), torch.float32, max_positions=512), seed=3)
    write_random_dflash_checkpoint(tmp_path / "dflash", cfg, num_layers=1, target_layer_ids=[0, 3])
    write_random_weaver_checkpoint(tmp_path / "weaver.pth", cfg, variant=1)
    drafter = load_dflash_drafter(tmp_path / "dflash", model, cfg, "cpu", torch.float32, max_len=320)
    runner = ModelRunner(model, max_len=256, device=torch.device("cpu"), use_cuda_graph=False)
    steps, step = [], tune.SpeculativeDecoder.step

    def counted(self, params, generator):
        out = step(self, params, generator)
        steps.append(self.last_step_drafts + 1)  # nodes verified
        return out

    monkeypatch.setattr(tune.SpeculativeDecoder, "step", counted)
    tune.exercise(tune.Target(runner, cfg, drafter, tmp_path / "weaver.pth"), [20], 16, context=40, steps=2)
    assert steps == [16, 16, 21, 21, 21, 21]  # DFLASH (the block), DDTREE 20, DFLASH_TFM 20
    assert not tuning.cache_dir().exists() or not any(tuning.cache_dir().iterdir())
