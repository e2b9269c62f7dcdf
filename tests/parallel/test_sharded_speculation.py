"""Speculative decoding with the target split over 2 gloo ranks: the drafter and Weaver are replicated, so every
rank builds the same tree and accepts the same path, and greedy output equals tp 1 token for token and step for
step (the same accepted lengths, so the trees and verifies agree, not only the final tokens), for DFLASH, DDTREE
and DFLASH_TFM, and for the adaptive budget, whose ranks must choose the same sizes; sampled with one seed, the
ranks draw the same tokens.

On the tiny dense, hybrid and MoE targets: random drafters and Weavers (the real drafter replicated, almost
every draft rejected), and an oracle drafter that knows the greedy continuation but ranks the right token second
at every third position, so steps accept long paths, through second siblings in the trees."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dflash_tfm.config import ModelConfig
from dflash_tfm.engine.decoder_factory import build_decoder, build_proposer
from dflash_tfm.engine.model_runner import ModelRunner
from dflash_tfm.engine.speculative import SpeculativeDecoder
from dflash_tfm.loading.loader import load_model, open_checkpoint
from dflash_tfm.parallel.sharding import Shard
from dflash_tfm.sampling import make_generator
from dflash_tfm.sampling_params import SamplingParams
from dflash_tfm.spec.fixtures import write_random_dflash_checkpoint
from dflash_tfm.spec.weaver_fixtures import write_random_weaver_checkpoint
from dflash_tfm.speculative_config import SpeculativeConfig
from tests import spec_config

from ..models.tiny_targets import VOCAB, save_hf_model
from .ranks import run_ranks

CPU = torch.device("cpu")
PROMPT = [5, 17, 42, 8, 77, 3, 61, 29, 11, 50]
N_TOKENS = 40
BLOCK = 8


class OracleDrafter:
    """Drafts the known greedy continuation, the right token ranked second at every third position."""

    def __init__(self, continuation: list[int], hidden: int) -> None:
        self.config = SimpleNamespace(target_layer_ids=[0], block_size=BLOCK)
        self.continuation, self.hidden = continuation, hidden

    def reset(self) -> None: ...

    def append_context(self, taps, start: int) -> None: ...

    def draft(self, root: torch.Tensor, position: torch.Tensor, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        logits = torch.zeros(1, BLOCK - 1, VOCAB)
        for k in range(1, BLOCK):
            i = int(position) - len(PROMPT) + k
            right = self.continuation[i] if i < len(self.continuation) else 0
            logits[0, k - 1, right] = 25.0
            if (int(position) + k) % 3 == 0:
                logits[0, k - 1, (right + 1) % VOCAB] = 26.0
        return logits, torch.zeros(1, BLOCK - 1, self.hidden)


def decode_run(rank: int, tp: int, target: str, root: str, algorithm: str | None, budget: int | str,
               oracle: list[int] | None = None, temperature: float = 0.0) -> tuple[list[int], list[int]]:
    """Tokens and tokens per step of one rank, greedy or sampled with seed 7; with `oracle` (the greedy
    continuation) the oracle drafter drafts."""
    source, raw, _ = open_checkpoint(target)
    model, cfg = load_model(source, raw, CPU, torch.float32, 512, progress=False, shard=Shard(rank, tp))
    runner = ModelRunner(model, max_len=256, device=CPU, use_cuda_graph=False)
    spec = spec_config(algorithm, Path(root), budget) if algorithm else SpeculativeConfig()
    if oracle is None:
        decoder = build_decoder(runner, cfg, spec)
    else:
        decoder = SpeculativeDecoder(runner, OracleDrafter(oracle, cfg.hidden_size),
                                     build_proposer(spec, runner, cfg, BLOCK))
    params = SamplingParams(temperature=temperature, seed=7)
    generator = make_generator(params, CPU)
    tokens, per_step = [decoder.prefill(PROMPT, params, generator)], []
    while len(tokens) < N_TOKENS:
        out = decoder.step(params, generator)
        per_step.append(len(out))
        tokens += out
    return tokens[:N_TOKENS], per_step


@pytest.fixture(scope="module", params=["llama", "qwen3_5_text", "qwen3_5_moe_text"])
def target(request, tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("tp_spec")
    _, path = save_hf_model(request.param, root)
    cfg = ModelConfig.from_dict(open_checkpoint(path)[1])
    write_random_dflash_checkpoint(root / "dflash", cfg, num_layers=1, block_size=8,
                                   target_layer_ids=[0, cfg.num_layers - 1])
    write_random_weaver_checkpoint(root / "weaver.pth", cfg, variant=1, K=7)
    return str(path), str(root)


@pytest.mark.parametrize("algorithm, budget", [(None, 1), ("DFLASH", 1), ("DDTREE", 12), ("DFLASH_TFM", 12),
                                               ("DDTREE", "auto")])
def test_tp2_greedy_equals_tp1(target: tuple[str, str], algorithm: str | None, budget: int | str) -> None:
    """The adaptive budget picks sizes from step times measured in each run, so there the tokens are compared
    (its ranks decide with rank 0's times: had they chosen different sizes, their collectives would not match)."""
    expected = decode_run(0, 1, *target, algorithm, budget)
    ranks = run_ranks(2, decode_run, *target, algorithm, budget)
    assert ranks[0] == ranks[1]
    assert ranks[0][0] == expected[0]
    if budget != "auto":
        assert ranks[0][1] == expected[1]
    if algorithm is not None:  # and the speculation is lossless: plain greedy decoding's tokens
        assert expected[0] == decode_run(0, 1, *target, None, 1)[0]


@pytest.mark.parametrize("algorithm", ["DFLASH", "DDTREE", "DFLASH_TFM"])
def test_tp2_accepts_the_same_long_paths_as_tp1(target: tuple[str, str], algorithm: str) -> None:
    reference = decode_run(0, 1, *target, None, 1)[0] + [0] * BLOCK
    expected = decode_run(0, 1, *target, algorithm, 12, reference)
    assert expected[0] == reference[:N_TOKENS] and max(expected[1]) >= 3, expected[1]
    assert run_ranks(2, decode_run, *target, algorithm, 12, reference) == [expected, expected]


@pytest.mark.parametrize("algorithm", ["DDTREE", "DFLASH_TFM"])
def test_tp2_ranks_sample_the_same_tokens_with_one_seed(target: tuple[str, str], algorithm: str) -> None:
    """The ranks' logits agree bit for bit (the all-reduce hands every rank the same sum), so with the same seed
    they accept the same paths; and the draws are tp 1's, whose logits differ only in rounding."""
    reference = decode_run(0, 1, *target, None, 1)[0] + [0] * BLOCK
    expected = decode_run(0, 1, *target, algorithm, 12, reference, 1.0)
    ranks = run_ranks(2, decode_run, *target, algorithm, 12, reference, 1.0)
    assert ranks[0] == ranks[1] == expected
