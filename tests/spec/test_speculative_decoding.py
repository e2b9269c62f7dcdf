"""End-to-end speculative decoding on tiny random targets (hybrid GDN, dense, and a Qwen3.5-MoE hybrid whose every
feed-forward is 8 experts, top-2, plus a shared expert; its tree verify runs the experts grouped by expert, its
decode gathers each token's two):

* at temperature 0 every mode (DFLASH, DDTREE, DFLASH_TFM at budgets 8/16/64) reproduces plain greedy
  decoding token for token, with random drafters/Weavers (mostly rejections) and with oracle drafters
  (long accepted paths, including paths through non-first siblings);
* wiring: an oracle drafter proposing the target's own greedy continuation makes every step produce a
  full block (tau = block size) for DFLASH, and depth + 1 = 16 tokens for DDTREE and DFLASH_TFM.
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from benchmarks.tree_expectation import step_scoring
from dflash_tfm.config import ModelConfig
from dflash_tfm.engine.autoregressive import AutoregressiveDecoder
from dflash_tfm.engine.budget import BudgetController
from dflash_tfm.engine.decoder_factory import build_decoder, build_proposer
from dflash_tfm.engine.model_runner import ModelRunner
from dflash_tfm.engine.speculative import SpeculativeDecoder
from dflash_tfm.loading.loader import build_model
from dflash_tfm.models.random_init import init_random_
from dflash_tfm.sampling_params import SamplingParams
from dflash_tfm.spec.fixtures import write_random_dflash_checkpoint
from dflash_tfm.spec.weaver_fixtures import write_random_weaver_checkpoint
from dflash_tfm.speculative_config import SpeculativeConfig
from tests import spec_config

VOCAB = 96
BLOCK = 16
GREEDY = SamplingParams(temperature=0.0)
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=512, tie_word_embeddings=False)
TARGETS = {
    "hybrid": dict(TINY, model_type="qwen3_5_text", num_hidden_layers=4, full_attention_interval=2,
                   linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16, linear_value_head_dim=16,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    "dense": dict(TINY, model_type="llama", num_hidden_layers=3, rope_theta=10000.0),
}
TARGETS["moe"] = dict({k: v for k, v in TARGETS["hybrid"].items() if k != "intermediate_size"},
                      model_type="qwen3_5_moe_text", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32)
PROMPT = [5, 17, 42, 8, 77, 3, 61, 29, 11, 50]
N_TOKENS = 48


@pytest.fixture(scope="module", params=sorted(TARGETS))
def target(request, tmp_path_factory):
    cfg = ModelConfig.from_dict(TARGETS[request.param])
    model = init_random_(build_model(cfg, torch.device("cpu"), torch.float32, max_positions=512), seed=3)
    root = tmp_path_factory.mktemp("spec")
    write_random_dflash_checkpoint(root / "dflash", cfg, num_layers=1, block_size=BLOCK, target_layer_ids=[0, cfg.num_layers - 1])
    write_random_weaver_checkpoint(root / "weaver.pth", cfg, variant=1)
    return cfg, model, root


def runner_for(model) -> ModelRunner:
    return ModelRunner(model, max_len=256, device=torch.device("cpu"), use_cuda_graph=False)


def decode(decoder, n: int = N_TOKENS) -> tuple[list[int], list[int]]:
    """Tokens and tokens-per-step of a greedy run of >= n tokens."""
    tokens = [decoder.prefill(PROMPT, GREEDY, None)]
    per_step = []
    while len(tokens) < n:
        out = decoder.step(GREEDY, None)
        per_step.append(len(out))
        tokens += out
    return tokens[:n], per_step


def greedy_reference(model, n: int = N_TOKENS) -> list[int]:
    return decode(AutoregressiveDecoder(runner_for(model)), n)[0]


@pytest.mark.parametrize("algo, budget", [("DFLASH", 0), ("DDTREE", 8), ("DDTREE", 16), ("DDTREE", 64),
                                          ("DFLASH_TFM", 8), ("DFLASH_TFM", 16), ("DFLASH_TFM", 64)])
def test_random_drafters_reproduce_greedy(target, algo: str, budget: int) -> None:
    cfg, model, root = target
    decoder = build_decoder(runner_for(model), cfg, spec_config(algo, root, max(budget, 1)))
    assert decode(decoder)[0] == greedy_reference(model)


@pytest.mark.parametrize("algo", ["DDTREE", "DFLASH_TFM"])
def test_tracked_expected_acceptance_is_exact_when_greedy_and_unbiased_when_sampling(target, algo: str) -> None:
    """`track_expected`: greedy, the expectation is the realised count (every draw is certain); at T = 1 the
    realised accepted drafts over many seeded requests scatter around the sum of the expectations."""
    cfg, model, root = target
    decoder = build_decoder(runner_for(model), cfg, spec_config(algo, root, 16))
    decoder.track_expected = True
    accepted = 0
    decoder.prefill(PROMPT, GREEDY, None)
    for _ in range(6):
        accepted += len(decoder.step(GREEDY, None)) - 1
    assert decoder.expected_drafts() == pytest.approx(accepted, abs=1e-4)
    params = SamplingParams(temperature=1.0)
    realised = expected = 0.0
    for seed in range(24):
        generator = torch.Generator().manual_seed(seed)
        decoder.prefill(PROMPT, params, generator)
        for _ in range(4):
            realised += len(decoder.step(params, generator)) - 1
        expected += decoder.expected_drafts()
    assert expected > 5 and abs(realised - expected) < 4 * expected ** 0.5  # Poisson-like spread, 4 sigma


@pytest.mark.parametrize("algo", ["DFLASH", "DFLASH_TFM"])
def test_drafting_ahead_of_the_host_read_reproduces_greedy(target, algo: str) -> None:
    """draft_ahead (the CUDA default; off on the CPU): each step's draft is enqueued by the step before, for a
    key-length bound taken before the read. The same tokens, and near the cache end it stops drafting ahead."""
    cfg, model, root = target
    decoder = build_decoder(runner_for(model), cfg, spec_config(algo, root, 16))
    decoder.draft_ahead = True
    n = decoder.runner.max_len - len(PROMPT) - 1  # to the last cache slot: the last steps are plain decode steps
    assert decode(decoder, n)[0] == greedy_reference(model, n)


def test_published_tree_width_reproduces_greedy(target) -> None:
    """DFLASH_TFM with the published 8 children per expanded node (SpeculativeConfig.children_per_node; the
    default is 16) is lossless too."""
    cfg, model, root = target
    decoder = build_decoder(runner_for(model), cfg, spec_config("DFLASH_TFM", root, 64, children_per_node=8))
    assert decode(decoder)[0] == greedy_reference(model)


def test_shallower_weaver_reproduces_greedy(target, tmp_path) -> None:
    """A Weaver trained for K = 7 behind a block-16 drafter grows trees min(block − 1, K) = 7 deep, as the
    published system does; still lossless."""
    cfg, model, root = target
    (tmp_path / "dflash").symlink_to(root / "dflash")
    write_random_weaver_checkpoint(tmp_path / "weaver.pth", cfg, variant=1, K=7)
    decoder = build_decoder(runner_for(model), cfg, spec_config("DFLASH_TFM", tmp_path, 32))
    depths = []
    proposer = decoder.proposers[32]

    def build(*args):
        tokens, parents, depth = proposer.build(*args)
        depths.append(int(depth.max()))
        return tokens, parents, depth

    decoder.proposers[32] = dataclasses.replace(proposer, build=build)
    assert decode(decoder)[0] == greedy_reference(model)
    assert depths and max(depths) <= 7


class OracleDrafter:
    """Proposes the target's own greedy continuation (known in advance), optionally demoting the right token
    to second place at some depths so that tree modes must accept through a non-first sibling."""

    def __init__(self, continuation: list[int], prompt_len: int, hidden: int, demote_every: int = 0) -> None:
        self.config = SimpleNamespace(target_layer_ids=[0], block_size=BLOCK)
        self.continuation, self.prompt_len, self.hidden, self.demote_every = continuation, prompt_len, hidden, demote_every

    def reset(self) -> None: ...

    def append_context(self, taps, start: int) -> None: ...

    def draft(self, root: torch.Tensor, position: torch.Tensor, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        position = int(position)  # the decoder passes the committed length as a device tensor
        logits = torch.zeros(1, BLOCK - 1, VOCAB)
        for k in range(1, BLOCK):
            i = position - self.prompt_len + k
            right = self.continuation[i] if i < len(self.continuation) else 0
            wrong = (right + 1) % VOCAB
            if self.demote_every and (position + k) % self.demote_every == 0:
                logits[0, k - 1, wrong], logits[0, k - 1, right] = 25.0, 24.0
            else:
                logits[0, k - 1, right] = 25.0
        return logits, torch.zeros(1, BLOCK - 1, self.hidden)


@pytest.mark.parametrize("algo, budget, draft_ahead", [("DFLASH", 0, False), ("DDTREE", 64, False),
                                                       ("DFLASH_TFM", 64, False), ("DFLASH", 0, True),
                                                       ("DFLASH_TFM", 64, True)])
def test_oracle_drafter_accepts_whole_blocks(target, algo: str, budget: int, draft_ahead: bool) -> None:
    """(With draft_ahead, a draft made before the commit it follows would miss: whole blocks show it was not.)"""
    cfg, model, root = target
    reference = greedy_reference(model, N_TOKENS + 3 * BLOCK)
    runner = runner_for(model)
    drafter = OracleDrafter(reference, len(PROMPT), cfg.hidden_size)
    decoder = SpeculativeDecoder(runner, drafter, build_proposer(spec_config(algo, root, max(budget, 1)), runner, cfg, BLOCK),
                                 draft_ahead=draft_ahead)
    tokens, per_step = decode(decoder)
    assert tokens == reference[:N_TOKENS]
    assert per_step == [BLOCK] * len(per_step), per_step  # tau = block size = depth 15 + 1


@pytest.mark.parametrize("algo", ["DDTREE", "DFLASH_TFM"])
def test_trees_accept_through_second_siblings(target, algo: str) -> None:
    """The right token is only second-best at every 5th position: the chain stops there, trees continue."""
    cfg, model, root = target
    reference = greedy_reference(model, N_TOKENS + 3 * BLOCK)
    runner = runner_for(model)
    drafter = OracleDrafter(reference, len(PROMPT), cfg.hidden_size, demote_every=5)
    chain = SpeculativeDecoder(runner, drafter, build_proposer(SpeculativeConfig("DFLASH", tree_budget=1), runner, cfg, BLOCK))
    chain_tokens, chain_steps = decode(chain)
    tree = SpeculativeDecoder(runner, drafter, build_proposer(spec_config(algo, root, 64), runner, cfg, BLOCK))
    tree_tokens, tree_steps = decode(tree)
    assert chain_tokens == tree_tokens == reference[:N_TOKENS]
    assert max(chain_steps) <= 5 and len(tree_steps) < len(chain_steps)


def test_step_scoring_commits_like_step_and_scores_exactly(target) -> None:
    """The tree-expectation benchmark's step_scoring emits the greedy tokens as step does; at T = 0 its own tree's expectation is the drafts the
    step accepted, and another builder scored on the same draft gets its own (different) count."""
    cfg, model, root = target
    reference = greedy_reference(model, N_TOKENS + 3 * BLOCK)
    runner = runner_for(model)
    drafter = OracleDrafter(reference, len(PROMPT), cfg.hidden_size, demote_every=5)
    decoder = SpeculativeDecoder(runner, drafter, build_proposer(SpeculativeConfig("DDTREE", tree_budget=16), runner, cfg, BLOCK))
    others = [build_proposer(SpeculativeConfig("DFLASH", tree_budget=1), runner, cfg, BLOCK),
              build_proposer(SpeculativeConfig("DDTREE", tree_budget=16), runner, cfg, BLOCK)]
    tokens = [decoder.prefill(PROMPT, GREEDY, None)]
    tree_scores, chain_scores = [], []
    while len(tokens) < N_TOKENS:
        out, (own, chain, same) = step_scoring(decoder, GREEDY, None, others)
        assert own == same == len(out) - 1
        tree_scores.append(own)
        chain_scores.append(chain)
        tokens += out
    assert tokens[:N_TOKENS] == reference[:N_TOKENS]
    assert max(chain_scores) <= 4 < max(tree_scores)  # the chain stops at each demoted depth, the tree goes on


class CyclingBudget(BudgetController):
    """Takes every candidate size in turn (drafting each step), so one request crosses every size change."""

    def __init__(self, sizes) -> None:
        super().__init__(sizes, {b: 1.0 for b in sizes})
        self.turn = 0

    def wants_draft(self) -> bool:
        return True

    def choose(self, estimate) -> int:
        size = self.sizes[self.turn % len(self.sizes)]
        self.turn += 1
        self.chosen[size] += 1
        return size


@pytest.mark.parametrize("algo", ["DFLASH", "DDTREE", "DFLASH_TFM"])
def test_adaptive_budget_reproduces_greedy_while_sizes_change(target, algo: str) -> None:
    """tree_budget "auto": step times measured at build, then sizes changing every step (cycled, 0 = a plain
    decode step included) and as the controller picks them: the output is plain greedy decoding either way."""
    cfg, model, root = target
    reference = greedy_reference(model)
    decoder = build_decoder(runner_for(model), cfg, spec_config(algo, root, "auto"))
    times = decoder.budget.step_seconds
    assert 0 in times and len(times) >= 4 and all(t > 0 for t in times.values())
    measured = dict(times)
    assert decode(decoder)[0] == reference  # the controller's own choices
    taken = decoder.budget.chosen.keys()  # their times now follow the steps' wall times, drafts accounted for
    assert all(times[b] != measured[b] and times[b] > 0 for b in taken)
    decoder.budget = CyclingBudget(sorted(times))
    tokens, per_step = decode(decoder)
    assert tokens == reference
    assert decoder.budget.chosen.keys() == set(times)  # every size was taken
    assert 1 in per_step  # size-0 steps emit exactly the target's own token
