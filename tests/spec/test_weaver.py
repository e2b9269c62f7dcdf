"""Weaver: batched cached `step` against a plain float64 re-implementation, the three checkpoint variants,
the published parameter count, strict loading, and the published system's leniencies (extra top-level keys,
trees min(block − 1, K) deep)."""
from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dflash_tfm.config import ModelConfig
from dflash_tfm.errors import CheckpointError, CheckpointNotFoundError
from dflash_tfm.loading.loader import build_model
from dflash_tfm.models.decoder import CausalLM
from dflash_tfm.models.random_init import init_random_
from dflash_tfm.tree import ancestor_mask
from dflash_tfm.spec.weaver import Weaver, WeaverConfig, load_weaver
from dflash_tfm.spec.weaver_fixtures import write_random_weaver_checkpoint

K, BLOCK, VOCAB, HIDDEN = 15, 16, 160, 64
TINY_LLAMA = dict(model_type="llama", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96,
                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)


@pytest.fixture(autouse=True, scope="module")
def single_thread() -> Iterator[None]:
    """Tiny tensors: intra-op threads only add contention on shared CPU runners (10× slower when loaded)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_target(hidden: int = HIDDEN) -> tuple[CausalLM, ModelConfig]:
    cfg = ModelConfig.from_dict({**TINY_LLAMA, "hidden_size": hidden})
    return init_random_(build_model(cfg, torch.device("cpu"), torch.float32, 64)), cfg


class RefWeaver:
    """Straightforward float64 Weaver from the raw checkpoint dict: no caches, the whole [prefix ; path]
    sequence recomputed per node under one causal mask (the path's rows are exactly its ancestors)."""

    def __init__(self, payload: dict, target: CausalLM) -> None:
        self.sd = {k: v.double() for k, v in payload["state_dict"].items()}
        self.cfg = payload["config"]
        self.gelu = "pos_emb" in self.sd
        self.embed, self.lm_head = target.embed_tokens.double(), target.lm_head_weight.double()
        self.heads = self.cfg["num_heads"]

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * self.sd[f"{name}.weight"] + self.sd[f"{name}.bias"]

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        bias = self.sd.get(f"{name}.bias")
        return x @ self.sd[f"{name}.weight"].T + (0 if bias is None else bias)

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        hd = x.shape[-1]
        freq = self.cfg["rope_base"] ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        ang = pos.double()[:, None] * freq
        cos, sin = ang.cos().repeat(1, 2)[:, None], ang.sin().repeat(1, 2)[:, None]
        return x * cos + torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], -1) * sin

    def block(self, i: int, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        b, t = f"blocks.{i}.", x.shape[0]
        h = self.norm(x, b + "norm_attn")
        if b + "q_proj.weight" in self.sd:
            q, k, v = (self.linear(h, f"{b}{p}_proj") for p in "qkv")
        else:
            q, k, v = self.linear(h, b + "qkv_proj").chunk(3, -1)
        q, k, v = (z.view(t, self.heads, -1) for z in (q, k, v))
        if not self.gelu:
            q, k = self.rope(q, pos), self.rope(k, pos)
        scores = torch.einsum("ihd,jhd->hij", q, k) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
        x = x + self.linear(torch.einsum("hij,jhd->ihd", scores.softmax(-1), v).reshape(t, -1), b + "o_proj")
        h = self.norm(x, b + "norm_mlp")
        if self.gelu:
            return x + self.linear(F.gelu(self.linear(h, b + "fc1")), b + "fc2")
        gate, up = self.linear(h, b + "gate_up_proj").chunk(2, -1)
        return x + self.linear(F.silu(gate) * up, b + "down_proj")

    def node_output(self, h_target: torch.Tensor, h_dflash: torch.Tensor, path: list[int], tokens: list[int]) -> torch.Tensor:
        """out_norm of the last row for the root→node path (tokens of the path, root first)."""
        feats = torch.cat([h_target[None], h_dflash]).double()
        prefix = self.linear(self.norm(feats, "output_norm"), "proposal_in")
        rows = self.linear(self.norm(self.embed[tokens], "embed_norm"), "token_in")
        depths = torch.arange(len(path))
        if self.gelu:
            prefix = torch.cat([prefix[:1], prefix[1:] + self.sd["pos_emb"]])
            rows = rows + self.sd["pos_emb"][depths.clamp(max=K - 1)]
        x = torch.cat([prefix, rows])
        pos = torch.cat([torch.arange(K + 1), depths.clamp(max=K) + 1])
        for i in range(self.cfg["num_layers"]):
            x = self.block(i, x, pos)
        return self.norm(x[-1], "out_norm")

    def child_logits(self, query: torch.Tensor, ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        w_res = self.lm_head[ids] @ self.sd["lm_head_query_in.weight"]
        return logits.double() + w_res @ query.double()


def path_to(parents: list[int], node: int) -> list[int]:
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.fixture(scope="module")
def target() -> tuple[CausalLM, ModelConfig]:
    return tiny_target()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, target) -> dict[int, tuple[Path, dict]]:
    root = tmp_path_factory.mktemp("weaver")
    out = {}
    for variant in (1, 2, 3):
        path = root / f"weaver_v{variant}.pth"
        out[variant] = (path, write_random_weaver_checkpoint(path, target[1], variant=variant, num_layers=2, seed=3))
    return out


def random_tree(n: int, seed: int) -> torch.Tensor:
    """Parents of a random topologically ordered tree with a depth-K spine (exercises the depth clamps)."""
    gen = torch.Generator().manual_seed(seed)
    parents, depths = [-1] + list(range(K)), list(range(K + 1))
    while len(parents) < n:
        p = int(torch.randint(len(parents), (), generator=gen))
        if depths[p] < K:
            parents.append(p)
            depths.append(depths[p] + 1)
    return torch.tensor(parents)


@pytest.mark.parametrize("variant", [1, 2, 3])
def test_step_matches_reference_for_every_node(variant: int, target, checkpoints) -> None:
    model, cfg = target
    path, payload = checkpoints[variant]
    weaver = load_weaver(path, model, cfg, BLOCK, "cpu", torch.float32)
    ref = RefWeaver(payload, model)
    gen = torch.Generator().manual_seed(variant)
    h_target, h_dflash = torch.randn(HIDDEN, generator=gen), torch.randn(K, HIDDEN, generator=gen)
    n = 30
    parents = random_tree(n, seed=variant)
    tokens = torch.randint(VOCAB, (n,), generator=gen)
    anc = ancestor_mask(parents)
    depths = anc.sum(-1) - 1
    cache = weaver.encode_prefix(h_target, h_dflash, n)
    outs = []
    for start in range(0, n, 4):  # batches mix parents with their children: allowed by `step`
        s = slice(start, min(start + 4, n))
        outs.append(weaver.step(cache, torch.arange(n)[s], tokens[s], depths[s], anc[s]))
    got = torch.cat(outs)
    paths = [path_to(parents.tolist(), i) for i in range(n)]
    want = torch.stack([ref.node_output(h_target, h_dflash, p, tokens[p].tolist()) for p in paths])
    assert rel_err(got, want) <= 1e-5

    ids = torch.randint(VOCAB, (n, 12), generator=gen)
    logits = torch.randn(n, 12, generator=gen)
    want_logits = torch.stack([ref.child_logits(want[i], ids[i], logits[i]) for i in range(n)])
    assert rel_err(weaver.child_logits(got, ids, logits), want_logits) <= 1e-5


def test_variant3_loads_to_variant2(target, checkpoints) -> None:
    model, cfg = target
    w2, w3 = (load_weaver(checkpoints[v][0], model, cfg, BLOCK, "cpu", torch.float32) for v in (2, 3))
    assert w2.state_dict().keys() == w3.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(w2.state_dict().values(), w3.state_dict().values()))
    h_target, h_dflash = torch.randn(HIDDEN), torch.randn(K, HIDDEN)
    c2, c3 = w2.encode_prefix(h_target, h_dflash, 1), w3.encode_prefix(h_target, h_dflash, 1)
    args = (torch.tensor([0]), torch.tensor([9]), torch.tensor([0]), torch.tensor([[True]]))
    assert torch.equal(w2.step(c2, *args), w3.step(c3, *args))


def test_published_variant2_parameter_count() -> None:
    cfg = WeaverConfig(d_model=5120, d_embed=5120, d_rank=2048, num_layers=1, num_heads=16, mlp_dim=2048, K=15,
                       candidate_pool_size=512, activation="gelu")
    with torch.device("meta"):
        model = Weaver(cfg)
    assert sum(math.prod(t.shape) for t in model.state_dict().values()) == 56_694_784


def edit(payload: dict, config: dict | None = None, drop: tuple[str, ...] = (), add: dict | None = None) -> dict:
    sd = {k: v for k, v in payload["state_dict"].items() if k not in drop}
    return {**payload, "config": {**payload["config"], **(config or {})}, "state_dict": {**sd, **(add or {})}}


BAD = {
    "missing key": (1, lambda p: edit(p, drop=("out_norm.bias",)), r"missing tensor 'out_norm\.bias'"),
    "extra key": (1, lambda p: edit(p, add={"blocks.0.extra.weight": torch.zeros(2)}), r"unexpected tensor 'blocks\.0\.extra"),
    "pos_emb in variant 1": (1, lambda p: edit(p, add={"pos_emb": torch.zeros(K, 64)}), r"unexpected tensor 'pos_emb'"),
    "wrong shape": (1, lambda p: edit(p, add={"blocks.1.o_proj.weight": torch.zeros(64, 63)}),
                    r"'blocks\.1\.o_proj\.weight': expected shape \[64, 64\], found \[64, 63\]"),
    "d_model mismatch": (1, lambda p: edit(p, config={"d_model": 32}), r"d_model 32 does not match the target hidden size 64"),
    "d_embed mismatch": (2, lambda p: edit(p, config={"d_embed": 48}), r"d_embed 48 does not match the target embedding dim 64"),
    "unknown activation": (1, lambda p: edit(p, config={"activation": "relu"}), r"unknown Weaver activation 'relu'"),
    "activation vs keys": (2, lambda p: edit(p, config={"activation": "swiglu"}), r"mixed variant"),
    "mixed mlp keys": (1, lambda p: edit(p, add={"blocks.0.fc1.weight": torch.zeros(128, 64)}), r"mixes variant keys"),
    "mixed qkv keys": (3, lambda p: edit(p, add={"blocks.0.qkv_proj.weight": torch.zeros(192, 64)}), r"mixes variant keys"),
    "split qkv incomplete": (3, lambda p: edit(p, drop=("blocks.0.v_proj.weight",)), r"missing Weaver tensor 'blocks\.0\.v_proj"),
    "unknown config key": (1, lambda p: edit(p, config={"dropout": 0.1}), r"unknown keys \['dropout'\]"),
    "missing config key": (1, lambda p: {**p, "config": {k: v for k, v in p["config"].items() if k != "mlp_dim"}},
                           r"missing \['mlp_dim'\]"),
    "not a payload": (1, lambda p: p["state_dict"], r"expected a dict with 'config' and 'state_dict'"),
    "wrong kind": (1, lambda p: {**p, "metadata": {"speculator_kind": "eagle3"}}, r"speculator_kind is 'eagle3'"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_strict_loading_errors(case: str, target, checkpoints, tmp_path) -> None:
    variant, mutate, message = BAD[case]
    path = tmp_path / "bad.pth"
    torch.save(mutate(checkpoints[variant][1]), path)
    with pytest.raises(CheckpointError, match=message):
        load_weaver(path, target[0], target[1], BLOCK, "cpu", torch.float32)


def test_unreadable_and_missing_files(target, tmp_path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="not found"):
        load_weaver(tmp_path / "nope.pth", target[0], target[1], BLOCK, "cpu", torch.float32)
    (tmp_path / "junk.pth").write_bytes(b"not a torch file")
    with pytest.raises(CheckpointError, match="cannot read Weaver checkpoint"):
        load_weaver(tmp_path / "junk.pth", target[0], target[1], BLOCK, "cpu", torch.float32)


def test_target_with_other_width_is_rejected(checkpoints) -> None:
    model, cfg = tiny_target(hidden=48)
    with pytest.raises(CheckpointError, match="d_model 64 does not match the target hidden size 48"):
        load_weaver(checkpoints[1][0], model, cfg, BLOCK, "cpu", torch.float32)


def test_extra_top_level_keys_are_ignored_and_logged(target, checkpoints, tmp_path, caplog) -> None:
    """The published system's files may carry more than config / state_dict / metadata (a step, optimizer state)."""
    path = tmp_path / "extra.pth"
    torch.save({**checkpoints[1][1], "step": 1200, "optimizer": {"lr": 1e-4}}, path)
    with caplog.at_level("INFO", logger="dflash_tfm.spec.weaver"):
        weaver = load_weaver(path, target[0], target[1], BLOCK, "cpu", torch.float32)
    assert "['optimizer', 'step']" in caplog.text
    reference = load_weaver(checkpoints[1][0], target[0], target[1], BLOCK, "cpu", torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(weaver.state_dict().values(), reference.state_dict().values()))


@pytest.mark.parametrize("variant", [1, 2])
def test_depth_is_min_of_block_and_k(variant: int, target, tmp_path) -> None:
    """A K = 15 Weaver behind a block-8 drafter grows 7-deep trees and computes exactly what a K = 7 Weaver with
    the same weights does (variant 2: the first 7 position embeddings); behind a block-16 drafter a K = 7 Weaver
    keeps K = 7."""
    model, cfg = target
    deep, shallow = tmp_path / "k15.pth", tmp_path / "k7.pth"
    write_random_weaver_checkpoint(deep, cfg, variant=variant, K=15, seed=4)
    write_random_weaver_checkpoint(shallow, cfg, variant=variant, K=7, seed=4)
    limited = load_weaver(deep, model, cfg, 8, "cpu", torch.float32)
    native = load_weaver(shallow, model, cfg, 8, "cpu", torch.float32)
    assert limited.config.K == native.config.K == 7
    assert load_weaver(shallow, model, cfg, BLOCK, "cpu", torch.float32).config.K == 7
    assert limited.state_dict().keys() == native.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(limited.state_dict().values(), native.state_dict().values()))
    gen = torch.Generator().manual_seed(1)
    h_target, h_dflash = torch.randn(HIDDEN, generator=gen), torch.randn(7, HIDDEN, generator=gen)
    parents = torch.tensor([-1, 0, 1, 1, 2, 4, 5, 6])
    anc = ancestor_mask(parents)
    depths, tokens = anc.sum(-1) - 1, torch.randint(VOCAB, (8,), generator=gen)
    outs = []
    for weaver in (limited, native):
        cache = weaver.encode_prefix(h_target, h_dflash, 8)
        outs.append(weaver.step(cache, torch.arange(8), tokens, depths, anc))
    assert torch.equal(outs[0], outs[1])
