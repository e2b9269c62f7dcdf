"""GPU-only: the CUDA paths of the target (fused element-wise ops, fla prefill, fused GDN decode kernel,
tree-attention decode, CUDA-graph replay, Triton tree verify/commit) against plain full-sequence prefill."""
from __future__ import annotations

import pytest
import torch

from dflash_tfm.config import ModelConfig
from dflash_tfm.engine.model_runner import ModelRunner
from dflash_tfm.layers import attention
from dflash_tfm.loading.loader import build_model
from dflash_tfm.models.random_init import init_random_
from dflash_tfm.tree import TreeSpec, random_parents


pytestmark = pytest.mark.gpu

TINY = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, rms_norm_eps=1e-6, max_position_embeddings=1024, tie_word_embeddings=False)
TARGETS = {
    "hybrid": dict(TINY, model_type="qwen3_5_text", num_hidden_layers=4, full_attention_interval=2,
                   linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=32, linear_value_head_dim=32,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}),
    "dense": dict(TINY, model_type="qwen3", num_hidden_layers=3, rope_theta=10000.0),
}
# fp32: fla-core's chunk prefill (the reference and every prefill here) runs its dots in TF32 (~1e-3 per layer).
TOLERANCE = {torch.float32: 4e-3, torch.bfloat16: 5e-2}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def full_logits(model, ids: torch.Tensor) -> torch.Tensor:
    runner = ModelRunner(model, max_len=512, device=ids.device, use_cuda_graph=False)
    runner.reset()
    with torch.inference_mode():
        hidden, _ = model(ids.view(1, -1), torch.arange(len(ids), device=ids.device).view(1, -1), runner.cache, len(ids))
        return model.logits(hidden[0])


@pytest.fixture(scope="module", params=[(t, d) for t in sorted(TARGETS) for d in (torch.float32, torch.bfloat16)],
                ids=lambda p: f"{p[0]}-{str(p[1])[6:]}")
def target(request):
    name, dtype = request.param
    model = init_random_(build_model(ModelConfig.from_dict(TARGETS[name]), torch.device("cuda"), dtype, 1024), seed=1)
    return model, dtype


def test_graph_decode_matches_full_prefill(target) -> None:
    """Captured decode steps."""
    model, dtype = target
    ids = torch.randint(0, 256, (90,), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    ref = full_logits(model, ids)
    runner = ModelRunner(model, max_len=512, device=torch.device("cuda"), use_cuda_graph=True)
    runner.reset()
    last, _ = runner.prefill(ids[:60])
    assert rel_err(last, ref[59]) <= TOLERANCE[dtype]
    for t in range(60, 90):
        logits = runner.decode(ids[t : t + 1], t)
        assert rel_err(logits[0], ref[t]) <= TOLERANCE[dtype], f"position {t}"


@pytest.mark.parametrize("tile", attention.VERIFY_ATTENTION.candidates)
def test_triton_verify_and_commit_match_plain_decoding(target, tile) -> None:
    """The verify with each tile the tree attention's tuned choice may take (forced)."""
    with attention.VERIFY_ATTENTION.forced(tile):
        check_verify_and_commit(target)


def check_verify_and_commit(target) -> None:
    """Verify logits of every node equal plain decoding of its path; after commit, the next step matches."""
    model, dtype = target
    gen = torch.Generator("cuda").manual_seed(1)
    prompt = torch.randint(0, 256, (40,), device="cuda", generator=gen)
    n = 33
    parents = random_parents(n, "best_first", seed=3, max_depth=15).cuda()
    tokens = torch.randperm(256, device="cuda", generator=gen)[:n]
    runner = ModelRunner(model, max_len=512, device=torch.device("cuda"), use_cuda_graph=True)
    runner.reset()
    runner.prefill(prompt)
    tree = TreeSpec.build(tokens.view(1, -1), parents.view(1, -1), cache_len=40)
    with torch.inference_mode():
        hidden, _, saved = model.verify(tree, runner.cache, 40)
        logits = model.logits(hidden[0])
    path = [n - 1]
    while parents[path[-1]] >= 0:
        path.append(int(parents[path[-1]]))
    path = path[::-1]
    for node in path:
        prefix = [int(tokens[i]) for i in path[: path.index(node) + 1]]
        ref = full_logits(model, torch.cat([prompt, torch.tensor(prefix, device="cuda")]))[-1]
        assert rel_err(logits[node], ref) <= TOLERANCE[dtype], f"node {node}"
    accepted = torch.zeros(1, n, dtype=torch.bool, device="cuda")
    accepted[0, path] = True
    path_idx = torch.full((1, 16), -1, dtype=torch.long, device="cuda")
    path_idx[0, : len(path)] = torch.tensor(path, device="cuda")
    with torch.inference_mode():
        model.commit(runner.cache, 40, tree, saved, accepted, path_idx)
    nxt = runner.decode(torch.tensor([5], device="cuda"), 40 + len(path))[0]
    full = torch.cat([prompt, tokens[path], torch.tensor([5], device="cuda")])
    assert rel_err(nxt, full_logits(model, full)[-1]) <= TOLERANCE[dtype]
