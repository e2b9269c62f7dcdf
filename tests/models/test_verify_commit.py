"""Model-level tree verification: `verify` logits at every node equal plain decoding of that node's path,
nothing is written during verify, and after `commit(path)` the next decode step equals plain decoding.

Oracle: our plain prefill/decode, itself checked against transformers in test_parity.py. The mixture-of-experts
targets run their experts grouped by expert in verify (nodes × top-k > experts) and gathered per token in decode,
so the two ways are checked against each other too.
"""
from __future__ import annotations

import pytest
import torch

from dflash_tfm.config import ModelConfig
from dflash_tfm.engine.model_runner import ModelRunner
from dflash_tfm.loading.loader import build_model, load_weights, open_checkpoint
from dflash_tfm.tree import TreeSpec, random_parents

from .tiny_targets import VOCAB, save_hf_model

PROMPT_LEN = 21


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module", params=["qwen3_5_text", "qwen3_next", "qwen3_5_moe_text", "qwen3_next_moe", "llama"])
def model(request, tmp_path_factory):
    _, path = save_hf_model(request.param, tmp_path_factory.mktemp("ckpt"))
    source, raw, _ = open_checkpoint(path)
    cfg = ModelConfig.from_dict(raw)
    m = build_model(cfg, torch.device("cpu"), torch.float32, max_positions=512)
    load_weights(m, source, cfg, progress=False)
    return m


def random_tree(n: int, shape: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Parents of the given shape and tokens with distinct siblings."""
    parents = random_parents(n, shape, seed=seed, max_depth=15)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randperm(VOCAB, generator=gen)[:n]  # all distinct, so siblings are too
    return tokens, parents


def path_to(parents: torch.Tensor, node: int) -> list[int]:
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(int(parents[path[-1]]))
    return path[::-1]


def plain_logits(model, prompt: torch.Tensor, continuation: list[int]) -> torch.Tensor:
    runner = ModelRunner(model, max_len=128, device=torch.device("cpu"), use_cuda_graph=False)
    runner.reset()
    return runner.prefill(torch.cat([prompt, torch.tensor(continuation, dtype=torch.long)]))[0]


def snapshot(cache) -> list[torch.Tensor]:
    return [t.clone() for pair in (*cache.attention.values(), *cache.gdn.values()) for t in pair]


@pytest.mark.parametrize(
    "shape, n, gdn_kernel",
    [("chain", 6, "chunk"), ("star", 7, "chunk"), ("binary", 15, "chunk"), ("random", 20, "chunk"),
     ("best_first", 18, "chunk"), ("random", 12, "recurrent")],
)
def test_verify_matches_plain_decoding_and_commit_continues_it(model, shape: str, n: int, gdn_kernel: str) -> None:
    """Both GDN verify kernels (on the CPU their torch twins)."""
    prompt = torch.randint(0, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(n))
    tokens, parents = random_tree(n, shape, seed=n)
    runner = ModelRunner(model, max_len=128, device=torch.device("cpu"), use_cuda_graph=False)
    runner.reset()
    runner.prefill(prompt)
    before = snapshot(runner.cache)

    tree = TreeSpec.build(tokens.view(1, -1), parents.view(1, -1), cache_len=PROMPT_LEN)
    with torch.inference_mode():
        hidden, _, saved = model.verify(tree, runner.cache, PROMPT_LEN, gdn_kernel=gdn_kernel)
        logits = model.logits(hidden[0])
    for a, b in zip(before, snapshot(runner.cache)):
        assert torch.equal(a, b), "verify must not write any cache"
    for node in range(n):
        path = [int(tokens[i]) for i in path_to(parents, node)]
        assert rel_err(logits[node], plain_logits(model, prompt, path)) <= 1e-4, f"node {node}"

    leaf = n - 1
    path_nodes = path_to(parents, leaf)
    accepted = torch.zeros(1, n, dtype=torch.bool)
    accepted[0, path_nodes] = True
    path_indices = torch.full((1, 16), -1, dtype=torch.long)
    path_indices[0, : len(path_nodes)] = torch.tensor(path_nodes)
    with torch.inference_mode():
        model.commit(runner.cache, PROMPT_LEN, tree, saved, accepted, path_indices)
    bonus = int(logits[leaf].argmax())
    position = PROMPT_LEN + len(path_nodes)
    after = runner.decode(torch.tensor([bonus]), position)[0]
    expected = plain_logits(model, prompt, [int(tokens[i]) for i in path_nodes] + [bonus])
    assert rel_err(after, expected) <= 1e-4


def test_single_node_tree_is_an_autoregressive_step(model) -> None:
    """N = 1 (root only) verify + commit == one decode step."""
    prompt = torch.randint(0, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(5))
    runner = ModelRunner(model, max_len=128, device=torch.device("cpu"), use_cuda_graph=False)
    runner.reset()
    runner.prefill(prompt)
    tree = TreeSpec.build(torch.tensor([[7]]), torch.tensor([[-1]]), cache_len=PROMPT_LEN)
    with torch.inference_mode():
        hidden, _, saved = model.verify(tree, runner.cache, PROMPT_LEN)
        model.commit(runner.cache, PROMPT_LEN, tree, saved, torch.ones(1, 1, dtype=torch.bool), torch.zeros(1, 1, dtype=torch.long))
    assert rel_err(model.logits(hidden[0, 0]), plain_logits(model, prompt, [7])) <= 1e-4
    nxt = runner.decode(torch.tensor([9]), PROMPT_LEN + 1)[0]
    assert rel_err(nxt, plain_logits(model, prompt, [7, 9])) <= 1e-4
