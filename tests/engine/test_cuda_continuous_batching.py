"""GPU-only: continuous batching's steps as CUDA-graph replays (one per batch and key-length bucket) give every
request the tokens the same batch gives eagerly, and its solo greedy tokens; on tiny random hybrid, MoE and dense
targets, with requests joining and leaving and rows crossing the 256-key bucket."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dflash_tfm.config import ModelConfig
from dflash_tfm.engine.autoregressive import AutoregressiveDecoder
from dflash_tfm.engine.batch_runner import BatchRunner
from dflash_tfm.engine.continuous_batching import ContinuousBatch
from dflash_tfm.engine.detokenizer import IncrementalDetokenizer
from dflash_tfm.engine.model_runner import ModelRunner
from dflash_tfm.engine.result import GenerationStats
from dflash_tfm.engine.sequence import Sequence
from dflash_tfm.loading.loader import build_model
from dflash_tfm.models.random_init import init_random_
from dflash_tfm.sampling_params import SamplingParams
from tests.spec.test_speculative_decoding import TARGETS

pytestmark = pytest.mark.gpu

MAX_LEN = 512
NEW_TOKENS = 40
PROMPT_LENGTHS = (5, 240, 17, 100, 9)  # the 240-token row decodes past 256 keys: a second key-length bucket
TOKENIZER = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)))


@pytest.fixture(scope="module", params=sorted(TARGETS))
def target(request):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = ModelConfig.from_dict(TARGETS[request.param])
    return cfg, init_random_(build_model(cfg, torch.device("cuda"), torch.float32, max_positions=MAX_LEN), seed=3)


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def run_batch(batch: ContinuousBatch, prompt_list: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Each prompt arrives at step 3·i (or when a slot frees) -> its NEW_TOKENS tokens."""
    out: dict[int, list[int]] = {}
    index: dict[Sequence, int] = {}
    waiting, step = list(range(len(prompt_list))), 0
    while waiting or batch.running:
        while waiting and 3 * waiting[0] <= step and batch.free_slots:
            i = waiting.pop(0)
            seq = Sequence(prompt_list[i], params, set(), NEW_TOKENS, None, IncrementalDetokenizer(TOKENIZER, []),
                           GenerationStats(prompt_tokens=len(prompt_list[i])))
            batch.add(seq)
            index[seq], out[i] = i, []
        for seq, delta in batch.step():
            out[index[seq]] += delta.token_ids
        step += 1
    return [out[i] for i in range(len(prompt_list))]


def test_graph_steps_equal_eager_and_solo_greedy(target) -> None:
    cfg, model = target
    greedy = SamplingParams(temperature=0.0)
    items = prompts(cfg.vocab_size)
    outputs = {}
    for graphs in (True, False):
        runner = BatchRunner(model, 3, MAX_LEN, torch.device("cuda"), use_cuda_graph=graphs)
        outputs[graphs] = run_batch(ContinuousBatch(runner, prefill_chunk=64), items, greedy)
        if graphs:
            keys = [(rows, kv) for rows in (1, 2, 3) for kv in (256, 512) if ("decode", rows, kv) in runner.graphs]
            assert {kv for _, kv in keys} == {256, 512} and {rows for rows, _ in keys} >= {1, 3}, keys
    assert outputs[True] == outputs[False]  # same kernels, replayed: bit-identical
    solo = AutoregressiveDecoder(ModelRunner(model, MAX_LEN, torch.device("cuda")))
    for prompt, got in zip(items, outputs[True]):
        expected = [solo.prefill(prompt, greedy, None)]
        while len(expected) < NEW_TOKENS:
            expected += solo.step(greedy, None)
        assert got[:16] == expected[:16]  # (later tokens may flip on near-ties: batched GEMMs round differently)
