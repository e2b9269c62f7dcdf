"""DFlash drafter: cached, static-shape `draft` equals a plain re-implementation without cache; embeddings and
lm_head are shared with the target; real target taps feed the context; bad checkpoints fail clearly.

Oracle: `reference_draft` below, written from the z-lab reference semantics (attention over [ctx ; block] with
explicit masks, K/V of ctx from each layer's k_proj/v_proj of the same hidden_norm(fc(taps))), no cache.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from dflash_tfm.config import ModelConfig
from dflash_tfm.spec import dflash as dflash_module
from dflash_tfm.engine.model_runner import ModelRunner
from dflash_tfm.errors import CheckpointError
from dflash_tfm.loading.loader import build_model
from dflash_tfm.models.random_init import init_random_
from dflash_tfm.spec.dflash import DFlashDrafter, load_dflash_drafter
from dflash_tfm.spec.dflash_config import DFlashConfig, default_target_layer_ids
from dflash_tfm.spec.fixtures import write_random_dflash_checkpoint

SW, FULL = "sliding_attention", "full_attention"
BASE = dict(vocab_size=160, hidden_size=64, intermediate_size=96, rms_norm_eps=1e-6, max_position_embeddings=256)
TARGETS = {
    "qwen3_5_text": dict(
        BASE, model_type="qwen3_5_text", num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16, linear_value_head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    ),
    "llama": dict(BASE, model_type="llama", num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                  tie_word_embeddings=True, rope_theta=10000.0),
}
TAPS = {"qwen3_5_text": [0, 2, 3], "llama": [1, 3]}  # K taps need not equal the 3 drafter layers
MAX_LEN = 64
# Prefill, then commits of different lengths; a draft after each, alternately with the tightest static kv_len
# (L+B: with window 20 the sliding layers read slots [0, kv_len) at L=13 and gather their window at L=25)
# and with the whole cache.
PIECES = [13, 3, 1, 6, 2]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module", params=list(TARGETS))
def target(request):
    cfg = ModelConfig.from_dict(TARGETS[request.param])
    model = init_random_(build_model(cfg, torch.device("cpu"), torch.float32, max_positions=MAX_LEN), seed=1)
    return request.param, cfg, model


def write_drafter(tmp_path: Path, arch: str, cfg: ModelConfig, window: int) -> Path:
    return write_random_dflash_checkpoint(
        tmp_path / "drafter", cfg, num_layers=3, block_size=8, layer_types=[SW, FULL, SW], sliding_window=window,
        target_layer_ids=TAPS[arch], seed=3,
    )


# ---------------------------------------------------------------------------------------------------------
# Oracle: straightforward attention over [ctx ; block] with explicit masks, no cache.


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x [T, h, D] rotate-half RoPE over the full head dim at positions pos [T]."""
    D = x.shape[-1]
    ang = pos.double()[:, None] / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None].float(), torch.cat([ang.sin(), ang.sin()], -1)[:, None].float()
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def block_mask(L: int, B: int, window: int | None, causal: bool) -> torch.Tensor:
    """[B, L+B] bool: block query a (position L+a) sees key position p (keys within the window, if any; inside
    the block only earlier positions when causal)."""
    m = torch.ones(B, L + B, dtype=torch.bool)
    for a in range(B):
        for p in range(L + B):
            q = L + a
            inside = window is None or q - p < window
            m[a, p] = inside and (p <= q if causal else (window is None or p - q < window))
    return m


def reference_draft(sd: dict, cfg: DFlashConfig, embed: torch.Tensor, lm_head: torch.Tensor, feats: torch.Tensor,
                    root: int, L: int, rotate=None) -> tuple[torch.Tensor, torch.Tensor]:
    """feats [L, K*H] for context positions 0..L-1; returns logits [B-1, V], hidden [B-1, H]. `rotate(x, pos)`
    applies RoPE (default: plain RoPE with the config's base); the embeddings and logits are scaled and capped as
    the config's optional fields say (z-lab `_raw_input_embeddings`, `compute_logits`)."""
    B, D, eps = cfg.block_size, cfg.head_dim, cfg.rms_norm_eps
    nh, nkv = cfg.num_heads, cfg.num_kv_heads
    rotate = rotate or (lambda x, pos: rope(x, pos, cfg.rope_theta))
    ctx = rms(feats @ sd["fc.weight"].T, sd["hidden_norm.weight"], eps)
    h = embed[torch.tensor([root] + [cfg.mask_token_id] * (B - 1))] * cfg.input_embedding_scale
    qpos, kpos = torch.arange(L, L + B), torch.arange(L + B)
    for i, layer_type in enumerate(cfg.layer_types):
        w = {k[len(f"layers.{i}."):]: v for k, v in sd.items() if k.startswith(f"layers.{i}.")}
        x = rms(h, w["input_layernorm.weight"], eps)
        q = rotate(rms((x @ w["self_attn.q_proj.weight"].T).view(B, nh, D), w["self_attn.q_norm.weight"], eps), qpos)
        src = torch.cat([ctx, x])  # ctx is NOT input-normed; every layer projects the same ctx
        k = rms((src @ w["self_attn.k_proj.weight"].T).view(L + B, nkv, D), w["self_attn.k_norm.weight"], eps)
        k = rotate(k, kpos).repeat_interleave(nh // nkv, dim=1)
        v = (src @ w["self_attn.v_proj.weight"].T).view(L + B, nkv, D).repeat_interleave(nh // nkv, dim=1)
        sliding = layer_type == SW
        mask = block_mask(L, B, cfg.sliding_window if sliding else None, sliding and cfg.causal_sliding_in_block)
        scores = torch.einsum("qhd,khd->hqk", q, k) * D**-0.5
        attn = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        h = h + torch.einsum("hqk,khd->qhd", attn, v).reshape(B, nh * D) @ w["self_attn.o_proj.weight"].T
        x = rms(h, w["post_attention_layernorm.weight"], eps)
        h = h + (F.silu(x @ w["mlp.gate_proj.weight"].T) * (x @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T
    out = rms(h, sd["norm.weight"], eps)[1:]
    logits = (out @ lm_head.T) * cfg.output_multiplier
    if cfg.final_logit_softcapping:
        logits = torch.tanh(logits / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
    return logits, out


# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attention", ["sdpa", "tree_kernel"])
@pytest.mark.parametrize("window", [5, 20, 64])  # 5 < block and << context (gathered window); 20: both read paths;
@pytest.mark.parametrize("causal", [False, True])  # 64: no key ever outside the window (the tree kernel may serve)
@torch.no_grad()
def test_draft_matches_reference(target, tmp_path, window, causal, attention, monkeypatch):
    arch, cfg, model = target
    if attention == "tree_kernel":  # its pure-PyTorch twin on the CPU; the kernel itself: tests/kernels
        monkeypatch.setattr(dflash_module, "TREE_KERNEL_DEVICES", ("cuda", "cpu"))
    path = write_drafter(tmp_path, arch, cfg, window)
    drafter = load_dflash_drafter(path, model, cfg, "cpu", torch.float32, max_len=MAX_LEN, causal_sliding_in_block=causal)
    sd = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(7)
    feats = torch.randn(1, sum(PIECES), drafter.config.num_taps * cfg.hidden_size, generator=gen)
    drafter.reset()
    L = 0
    for step, n in enumerate(PIECES):
        drafter.append_context(feats[:, L : L + n], L)
        L += n
        root = int(torch.randint(0, cfg.vocab_size, (1,), generator=gen))
        B = drafter.config.block_size
        if step % 2:
            logits, hidden = drafter.draft(torch.tensor([root]), L)
        else:  # device-tensor position and the smallest static bound, as a CUDA graph would use
            logits, hidden = drafter.draft(torch.tensor([root]), torch.tensor(L), kv_len=L + B)
        ref_logits, ref_hidden = reference_draft(sd, drafter.config, model.embed_tokens, model.lm_head_weight, feats[0, :L], root, L)
        assert logits.dtype == torch.float32 and logits.shape == (1, B - 1, cfg.vocab_size)
        assert hidden.shape == (1, B - 1, cfg.hidden_size)
        assert rel_err(logits[0], ref_logits) <= 1e-5, (L, rel_err(logits[0], ref_logits))
        assert rel_err(hidden[0], ref_hidden) <= 1e-5


@pytest.mark.parametrize("attention", ["sdpa", "tree_kernel"])
@pytest.mark.parametrize("window", [5, 64])
@torch.no_grad()
def test_batched_draft_matches_reference_per_row(target, tmp_path, window, attention, monkeypatch):
    """Three cache rows with contexts of different lengths (one fed in two appends, one with per-row starts) drafted
    in one call, each row at its own position: every row's draft is the reference draft of its own context."""
    arch, cfg, model = target
    if attention == "tree_kernel":
        monkeypatch.setattr(dflash_module, "TREE_KERNEL_DEVICES", ("cuda", "cpu"))
    path = write_drafter(tmp_path, arch, cfg, window)
    drafter = load_dflash_drafter(path, model, cfg, "cpu", torch.float32, max_len=MAX_LEN)
    drafter.allocate(MAX_LEN, batch=4)
    sd = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(11)
    width = drafter.config.num_taps * cfg.hidden_size
    lengths = [30, 9, 21]
    feats = [torch.randn(1, n, width, generator=gen) for n in lengths]
    drafter.reset()
    drafter.append_context(feats[0], 0, first_row=0)
    drafter.append_context(feats[1][:, :4], 0, first_row=1)
    both = torch.cat((feats[1][:, 4:9], feats[2][:, 16:21]))  # two rows at once, each from its own start
    drafter.append_context(feats[2][:, :16], 0, first_row=2)
    drafter.append_context(both, torch.tensor([4, 16]), first_row=1)
    roots = torch.randint(0, cfg.vocab_size, (3,), generator=gen)
    B = drafter.config.block_size
    logits, hidden = drafter.draft(roots, torch.tensor(lengths), kv_len=max(lengths) + B)
    assert logits.shape == (3, B - 1, cfg.vocab_size) and hidden.shape == (3, B - 1, cfg.hidden_size)
    for r, L in enumerate(lengths):
        ref_logits, ref_hidden = reference_draft(sd, drafter.config, model.embed_tokens, model.lm_head_weight,
                                                 feats[r][0], int(roots[r]), L)
        assert rel_err(logits[r], ref_logits) <= 1e-5, (r, rel_err(logits[r], ref_logits))
        assert rel_err(hidden[r], ref_hidden) <= 1e-5


@torch.no_grad()
def test_causal_switch_changes_sliding_layers_only(target, tmp_path):
    """The switch must matter when sliding layers exist, and must not touch full-attention-only drafters."""
    arch, cfg, model = target
    outs = []
    for causal in (False, True):
        d = load_dflash_drafter(write_drafter(tmp_path, arch, cfg, 20), model, cfg, "cpu", torch.float32, MAX_LEN, causal)
        d.append_context(torch.ones(1, 10, d.fc.shape[1]), 0)
        outs.append(d.draft(torch.tensor([3]), 10)[0])
    assert rel_err(outs[0], outs[1]) > 1e-3
    full = write_random_dflash_checkpoint(tmp_path / "full", cfg, num_layers=2, block_size=8, target_layer_ids=TAPS[arch])
    outs = []
    for causal in (False, True):
        d = load_dflash_drafter(full, model, cfg, "cpu", torch.float32, MAX_LEN, causal)
        d.append_context(torch.ones(1, 10, d.fc.shape[1]), 0)
        outs.append(d.draft(torch.tensor([3]), 10)[0])
    assert torch.equal(outs[0], outs[1])


def test_embeddings_and_lm_head_are_shared(target, tmp_path):
    arch, cfg, model = target
    drafter = load_dflash_drafter(write_drafter(tmp_path, arch, cfg, 5), model, cfg, "cpu", torch.float32)
    assert drafter.embed_tokens.data_ptr() == model.embed_tokens.data_ptr()
    assert drafter.lm_head_weight.data_ptr() == model.lm_head_weight.data_ptr()
    shared = {model.embed_tokens.data_ptr(), model.lm_head_weight.data_ptr()}
    assert not shared & {p.data_ptr() for p in drafter.parameters()}
    assert not any("embed" in k or "lm_head" in k for k in drafter.state_dict())


@torch.no_grad()
def test_append_context_from_real_target_taps(target, tmp_path):
    """Prefill (in chunks, via the runner's tap callback) and a 3-token commit forward feed the drafter the
    target's tap-layer outputs as lists; the draft equals the oracle on the same features."""
    arch, cfg, model = target
    path = write_drafter(tmp_path, arch, cfg, 5)
    drafter = load_dflash_drafter(path, model, cfg, "cpu", torch.float32, max_len=MAX_LEN)
    taps_ids = tuple(drafter.config.target_layer_ids)
    runner = ModelRunner(model, max_len=MAX_LEN, device=torch.device("cpu"), use_cuda_graph=False, prefill_chunk=8)
    runner.reset()
    seen: list[torch.Tensor] = []

    def on_taps(taps: list[torch.Tensor], start: int) -> None:
        assert len(taps) == len(taps_ids) and all(t.shape[-1] == cfg.hidden_size for t in taps)
        drafter.append_context(taps, start)
        seen.append(torch.cat(taps, -1))

    prompt = torch.randint(0, cfg.vocab_size, (19,), generator=torch.Generator().manual_seed(0))
    runner.prefill(prompt, tap_layers=taps_ids, on_taps=on_taps)
    commit = torch.tensor([[5, 9, 11]])
    _, taps = model(commit, torch.arange(19, 22).view(1, 3), runner.cache, kv_len=22, tap_layers=taps_ids)
    on_taps(taps, 19)
    logits, hidden = drafter.draft(torch.tensor([42]), 22)
    sd = load_file(path / "model.safetensors")
    ref_logits, _ = reference_draft(sd, drafter.config, model.embed_tokens, model.lm_head_weight, torch.cat(seen, 1)[0], 42, 22)
    assert rel_err(logits[0], ref_logits) <= 1e-5


# ---------------------------------------------------------------------------------------------------------
# Config parsing and bad checkpoints.


def test_config_published_layout_and_default_taps():
    raw = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 5120, "num_hidden_layers": 5,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 17408,
        "rope_theta": 1e7, "layer_types": [SW, SW, SW, SW, FULL], "sliding_window": 2048, "use_sliding_window": True,
        "num_target_layers": 64, "block_size": 16, "dflash_config": {"mask_token_id": 248070},
    }
    cfg = DFlashConfig.from_dict(raw)
    assert cfg.target_layer_ids == [1, 16, 31, 46, 61] and cfg.block_size == 16 and cfg.sliding_window == 2048
    assert cfg.mask_token_id == 248070 and cfg.rope_theta == 1e7
    assert cfg.causal_sliding_in_block  # the current reference's default without `is_causal`
    assert not DFlashConfig.from_dict(dict(raw, is_causal=False)).causal_sliding_in_block
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33] and default_target_layer_ids(36, 1) == [18]
    raw["dflash_config"]["block_size"] = 8  # dflash_config wins over the top level
    assert DFlashConfig.from_dict(raw, causal_sliding_in_block=True).block_size == 8
    with pytest.raises(CheckpointError, match="DFlash2DraftModel"):
        DFlashConfig.from_dict(dict(raw, architectures=["DFlash2DraftModel"]))
    with pytest.raises(CheckpointError, match="sliding_window"):
        DFlashConfig.from_dict(dict(raw, sliding_window=None))


@pytest.fixture(scope="module")
def llama_target():
    cfg = ModelConfig.from_dict(TARGETS["llama"])
    return cfg, init_random_(build_model(cfg, torch.device("cpu"), torch.float32, max_positions=MAX_LEN))


def _edit_weights(path: Path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")


def _expect_error(path: Path, target, *fragments: str, error=CheckpointError) -> None:
    cfg, model = target
    with pytest.raises(error) as info:
        load_dflash_drafter(path, model, cfg, "cpu", torch.float32)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_bad_checkpoints(llama_target, tmp_path):
    cfg, _ = llama_target
    good = write_random_dflash_checkpoint(tmp_path / "good", cfg, num_layers=2, block_size=8)

    def copy(name: str) -> Path:
        return Path(shutil.copytree(good, tmp_path / name))

    bad_taps = write_random_dflash_checkpoint(tmp_path / "taps", cfg, num_layers=2, target_layer_ids=[1, 6])
    _expect_error(bad_taps, llama_target, "[6]", "6 layers")

    fc = copy("fc")
    _edit_weights(fc, lambda t: t.update({"fc.weight": torch.zeros(64, 2 * 64 + 8)}))
    _expect_error(fc, llama_target, "fc.weight", "136", "128")

    narrow = dataclasses.replace(cfg, hidden_size=32)
    _expect_error(write_random_dflash_checkpoint(tmp_path / "hidden", narrow, num_layers=2), llama_target,
                  "hidden_size 32", "hidden_size 64")

    mask = write_random_dflash_checkpoint(tmp_path / "mask", cfg, num_layers=2, mask_token_id=cfg.vocab_size)
    _expect_error(mask, llama_target, "mask_token_id 160", "size 160")

    missing = copy("missing")
    _edit_weights(missing, lambda t: t.pop("layers.1.mlp.up_proj.weight"))
    _expect_error(missing, llama_target, "missing tensor 'layers.1.mlp.up_proj.weight'", "[96, 64]")

    extra = copy("extra")
    _edit_weights(extra, lambda t: t.update({"embed_tokens.weight": torch.zeros(160, 64)}))
    _expect_error(extra, llama_target, "unexpected tensor 'embed_tokens.weight'", "[160, 64]")

    shaped = copy("shaped")
    _edit_weights(shaped, lambda t: t.update({"layers.0.self_attn.k_norm.weight": torch.ones(17)}))
    _expect_error(shaped, llama_target, "'layers.0.self_attn.k_norm.weight'", "expected shape [16]", "found [17]")

    no_config = copy("no_config")
    (no_config / "config.json").unlink()
    _expect_error(no_config, llama_target, "no config.json", str(no_config), error=FileNotFoundError)
    _expect_error(tmp_path / "nowhere", llama_target, "not found", "nowhere")

    no_weights = copy("no_weights")
    (no_weights / "model.safetensors").unlink()
    _expect_error(no_weights, llama_target, "model.safetensors", str(no_weights))

    corrupt = copy("layers")
    raw = json.loads((corrupt / "config.json").read_text())
    (corrupt / "config.json").write_text(json.dumps(dict(raw, layer_types=[SW, FULL], sliding_window=None,
                                                         use_sliding_window=True)))
    _expect_error(corrupt, llama_target, "sliding_window")


def test_draft_argument_checks(llama_target, tmp_path):
    cfg, model = llama_target
    path = write_random_dflash_checkpoint(tmp_path / "d", cfg, num_layers=2, block_size=8)
    drafter = DFlashDrafter(DFlashConfig.from_dict(json.loads((path / "config.json").read_text())), model, max_len=32)
    with pytest.raises(ValueError, match="kv_len >= 33"):
        drafter.draft(torch.tensor([1]), 25)
    with pytest.raises(ValueError, match="width 10"):
        drafter.append_context(torch.zeros(1, 2, 10), 0)
    with pytest.raises(ValueError, match="exceed"):
        drafter.append_context(torch.zeros(1, 4, drafter.fc.shape[1]), 30)
    drafter.allocate(48)  # re-allocation (a longer max length) keeps the drafter usable
    drafter.append_context(torch.zeros(1, 25, drafter.fc.shape[1]), 0)
    assert drafter.draft(torch.tensor([1]), 25)[0].shape == (1, 7, cfg.vocab_size)
