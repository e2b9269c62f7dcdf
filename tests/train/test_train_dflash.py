"""DFlash drafter training: the training forward equals inference, training learns, the checkpoint round-trips.

Oracles: `DFlashDrafter.draft` (itself tested against a plain re-implementation in tests/spec/test_dflash.py)
for the training forward's masks and numerics; the untrained drafter for "training helps"; `load_dflash_drafter`
(strict) for the saved format. The data is synthetic and learnable: greedy continuations of random prompts by a
tiny random target, i.e. exactly what the drafter is meant to predict.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dflash_tfm.config import ModelConfig
from dflash_tfm.models.cache import ModelCache
from dflash_tfm.errors import CheckpointError
from dflash_tfm.loading.loader import build_model
from dflash_tfm.models.random_init import init_random_
from dflash_tfm.spec.dflash import attention_mask, load_dflash_drafter
from dflash_tfm.train.dflash_checkpoint import build_trainable_drafter, default_mask_token_id
from dflash_tfm.train.dflash_forward import block_attention_mask, block_forward
from dflash_tfm.spec.dflash_config import drafter_config_dict
from dflash_tfm.train.dflash_trainer import (IGNORE, block_loss, block_loss_and_hits, main, make_batch, soft_labels,
                                             train_dflash)
from dflash_tfm.train.rows import read_rows
from dflash_tfm.train.shapes import LENGTH_MULTIPLE, padded_length
from dflash_tfm.train.target_features import TargetFeatures
from tests.train.tiny_chat import save_tiny_chat_model

SW, FULL = "sliding_attention", "full_attention"
TARGET = dict(model_type="llama", vocab_size=160, hidden_size=64, intermediate_size=96, rms_norm_eps=1e-6,
              max_position_embeddings=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              tie_word_embeddings=True, rope_theta=10000.0)
MAX_LEN = 64
PROMPT_LEN, NEW_TOKENS = 8, 32


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # hundreds of tiny steps: thread hand-offs would dominate on shared cores
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target():
    cfg = ModelConfig.from_dict(TARGET)
    return init_random_(build_model(cfg, torch.device("cpu"), torch.float32, max_positions=128), seed=1)


@torch.no_grad()
def greedy_rows(model, n: int, seed: int) -> list[dict]:
    """The target's greedy continuations of n random prompts, batched through one cache."""
    cache = ModelCache(model.config, PROMPT_LEN + NEW_TOKENS, n, torch.float32, torch.device("cpu"))
    prompts = torch.randint(3, model.config.vocab_size, (n, PROMPT_LEN), generator=torch.Generator().manual_seed(seed))
    hidden, _ = model(prompts, torch.arange(PROMPT_LEN).expand(n, -1), cache, kv_len=PROMPT_LEN)
    out = [model.logits(hidden[:, -1]).argmax(-1)]
    for pos in range(PROMPT_LEN, PROMPT_LEN + NEW_TOKENS - 1):
        hidden, _ = model(out[-1].view(n, 1), torch.full((n, 1), pos), cache, kv_len=pos + 1)
        out.append(model.logits(hidden[:, -1]).argmax(-1))
    responses = torch.stack(out, 1)
    return [{"id": f"syn:{i}", "source": "synthetic", "prompt_ids": prompts[i].tolist(),
             "response_ids": responses[i].tolist()} for i in range(n)]


@pytest.fixture(scope="module")
def data_file(target, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "greedy.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in greedy_rows(target, 160, seed=0)))
    return path


def test_read_rows_for_the_drafter_truncates_and_skips_a_torn_last_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    full = [{"prompt_ids": [1, 2, 3], "response_ids": [4, 5, 6, 7]}, {"prompt_ids": [1] * 9, "response_ids": [2, 3]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in full) + '{"prompt_ids": [1, 2], "resp')
    rows = read_rows(path, max_len=6, min_response=2)
    assert [(r.tokens, r.prompt_len) for r in rows] == [([1, 2, 3, 4, 5, 6], 3)]  # the 2nd has no response left


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("layers,window,causal", [
    ([FULL, FULL], None, True),
    ([SW, FULL, SW], 3, True),  # window < block: windowing inside the block too
    ([SW, FULL, SW], 3, False),
])
def test_training_forward_equals_draft_of_saved_checkpoint(target, data_file, tmp_path, layers, window, causal):
    """Blocks computed together in training (several anchors per sequence, two sequences) give the logits
    `draft` gives for each block alone, on the drafter loaded back from the saved checkpoint."""
    B = 6
    result = train_dflash(target, data_file, tmp_path / "d", num_layers=len(layers), block_size=B, layer_types=layers,
                          target_layer_ids=[0, 2, 3],
                          sliding_window=window, causal_sliding_in_block=causal, steps=3, batch_size=4, lr=1e-2,
                          anchors_per_seq=4, max_len=MAX_LEN, val_frac=0.0, progress=False)
    trained = result.drafter.eval()
    loaded = load_dflash_drafter(tmp_path / "d", target, target.config, "cpu", torch.float32, max_len=MAX_LEN)
    assert loaded.config.causal_sliding_in_block == causal
    rows = read_rows(data_file, MAX_LEN)[:2]
    tokens = torch.tensor([r.tokens for r in rows])
    anchors = torch.tensor([[8, 11, 20, 30], [9, 10, 25, 36]])  # adjacent, overlapping and late blocks
    feats = TargetFeatures(target, loaded.config.target_layer_ids, MAX_LEN)(tokens)
    with torch.no_grad():
        hidden = block_forward(trained, feats, tokens, anchors)
        logits = hidden @ target.lm_head_weight.T
        for i in range(2):
            for j, a in enumerate(anchors[i].tolist()):
                loaded.reset()
                loaded.append_context(feats[i : i + 1, :a], 0)
                ref_logits, ref_hidden = loaded.draft(tokens[i, a].view(1), a)
                assert rel_err(logits[i, j], ref_logits[0]) <= 1e-5, (i, a, rel_err(logits[i, j], ref_logits[0]))
                assert rel_err(hidden[i, j], ref_hidden[0]) <= 1e-5


@pytest.mark.parametrize("window,causal", [(None, True), (None, False), (3, True), (3, False), (20, False)])
def test_block_mask_is_inference_mask_per_block(window, causal):
    """Row by row, the training mask restricted to block j's keys is `dflash.attention_mask` for a block at a_j
    with the context cached at positions < a_j; every other block is invisible."""
    T, B = 30, 4
    anchors = torch.tensor([[3, 4, 17, 26]])
    mask = block_attention_mask(anchors, T, B, window, causal)[0, 0]
    for j, a in enumerate(anchors[0].tolist()):
        rows = mask[j * B : (j + 1) * B]
        kpos = torch.cat((torch.arange(a), torch.full((T - a,), -1), torch.arange(a, a + B)))
        own = torch.cat((rows[:, :T], rows[:, T + j * B : T + (j + 1) * B]), dim=1)
        assert torch.equal(own, attention_mask(torch.arange(a, a + B).view(1, B), kpos.view(1, -1), window, causal)[0, 0])
        others = torch.cat((rows[:, T : T + j * B], rows[:, T + (j + 1) * B :]), dim=1)
        assert not others.any()


def test_training_learns_the_targets_continuations(target, data_file, tmp_path):
    """A few hundred steps cut the held-out loss clearly and raise per-position acceptance and the chain's
    expected accepted length over the untrained drafter (step-0 validation)."""
    result = train_dflash(target, data_file, tmp_path / "d", num_layers=1, block_size=4, steps=240, batch_size=8,
                          anchors_per_seq=8, lr=3e-3, max_len=MAX_LEN, val_frac=0.2, log_every=40, eval_every=120,
                          progress=False)
    first, last = result.validations[0], result.validations[-1]
    assert first.step == 0 and last.step == 240
    assert last.loss < 0.75 * first.loss, (first, last)
    assert all(a1 > a0 + 0.1 for a0, a1 in zip(first.acc, last.acc)), (first.acc, last.acc)
    assert last.accept_len > first.accept_len + 0.2 and last.streak > first.streak + 0.2
    assert result.log[-1]["loss"] < result.log[0]["loss"]
    assert result.saved_step == max(result.validations, key=lambda v: v.accept_len).step
    logged = [json.loads(line) for line in (tmp_path / "d" / "train_log.jsonl").read_text().splitlines()]
    assert sum("validation" in e for e in logged) == 3 and logged[-1]["validation"]["step"] == 240


@pytest.mark.parametrize("distill", [False, True])
def test_feature_store_trains_like_a_target_pass_per_step(target, data_file, tmp_path, distill):
    """Features gathered from the store (the default when they fit) or recomputed every step: same validations
    and losses, up to the target's batching round-off (with soft labels too: the store then keeps the target's
    final hidden states)."""
    kwargs = dict(num_layers=1, block_size=4, steps=6, batch_size=4, anchors_per_seq=4, lr=3e-3, max_len=MAX_LEN,
                  val_frac=0.2, log_every=1, eval_every=3, distill=distill, progress=False)
    stored = train_dflash(target, data_file, tmp_path / "a", cache_features=True, **kwargs)
    recomputed = train_dflash(target, data_file, tmp_path / "b", cache_features=False, **kwargs)
    for a, b in zip(stored.validations, recomputed.validations, strict=True):
        assert a.loss == pytest.approx(b.loss, rel=1e-4) and a.acc == pytest.approx(b.acc, abs=1e-6)
    assert [e["loss"] for e in stored.log] == pytest.approx([e["loss"] for e in recomputed.log], rel=1e-4)


def test_batches_pad_to_a_multiple_of_the_length_step_within_the_maximum(data_file):
    rows = read_rows(data_file, MAX_LEN, min_response=2)[:4]
    longest = max(len(r.tokens) for r in rows)
    gen = torch.Generator().manual_seed(0)
    assert make_batch(rows, 4, 4, gen, torch.device("cpu")).tokens.shape[1] == longest
    assert make_batch(rows, 4, 4, gen, torch.device("cpu"), max_length=1000).tokens.shape[1] == \
        -(-longest // LENGTH_MULTIPLE) * LENGTH_MULTIPLE
    assert make_batch(rows, 4, 4, gen, torch.device("cpu"), max_length=longest + 1).tokens.shape[1] == longest + 1
    assert padded_length(longest, longest - 1) == longest


def test_training_loss_is_the_validation_loss_and_its_gradient(target, data_file):
    """`block_loss` (the fused cross-entropy the optimizer steps on) equals `block_loss_and_hits`' loss, and so
    do their gradients, on a padded batch."""
    raw = drafter_config_dict(target.config, num_layers=1, block_size=4, mask_token_id=5, target_layer_ids=[0, 3],
                              dtype=torch.float32)
    drafter = build_trainable_drafter(raw, target, seed=0)
    drafter.allocate(MAX_LEN + 4)
    rows = read_rows(data_file, MAX_LEN, min_response=2)[:6]
    batch = make_batch(rows, 5, 4, torch.Generator().manual_seed(0), torch.device("cpu"), MAX_LEN)
    feats = TargetFeatures(target, [0, 3], MAX_LEN)(batch.tokens)
    decay = torch.exp(-torch.arange(3.0) / 7.0)
    params = [p for p in drafter.parameters() if p.requires_grad]
    want = block_loss_and_hits(drafter, feats, batch, decay)[0]
    want_grads = torch.autograd.grad(want, params)
    got = block_loss(drafter, feats, batch, decay)
    got_grads = torch.autograd.grad(got, params)
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert torch.allclose(g, w, rtol=1e-4, atol=1e-6)


def test_soft_labels_are_the_targets_next_token_distributions(target, data_file):
    """On the target's greedy rows, the soft label of every block position peaks at that position's label token
    (the target's distribution before it); one position off, clearly less often (the tiny target's greedy rows
    repeat tokens, so shifted labels still agree often: the alignment is what is tested)."""
    rows = read_rows(data_file, MAX_LEN, min_response=2)[:16]
    batch = make_batch(rows, 8, 4, torch.Generator().manual_seed(0), torch.device("cpu"))
    hidden, _ = TargetFeatures(target, [0], MAX_LEN).hidden_and_features(batch.tokens)
    valid = batch.labels != IGNORE
    heads = SimpleNamespace(lm_head_weight=target.lm_head_weight)
    soft = soft_labels(heads, hidden, batch.anchors, valid)
    assert soft.shape == (int(valid.sum()), target.config.vocab_size)
    assert torch.allclose(soft.sum(-1), torch.ones(len(soft)))
    assert (soft.argmax(-1) == batch.labels[valid]).float().mean() >= 0.99
    shifted = soft_labels(heads, hidden, batch.anchors + 1, valid)
    assert (shifted.argmax(-1) == batch.labels[valid]).float().mean() < 0.9


def test_distillation_learns_the_targets_continuations(target, data_file, tmp_path):
    """Soft labels train the drafter as well as hard ones do on greedy data: held-out acceptance (scored against
    the data's tokens) rises clearly over the untrained drafter."""
    result = train_dflash(target, data_file, tmp_path / "d", num_layers=1, block_size=4, steps=160, batch_size=8,
                          anchors_per_seq=8, lr=3e-3, max_len=MAX_LEN, val_frac=0.2, log_every=40, eval_every=80,
                          distill=True, progress=False)
    first, last = result.validations[0], result.validations[-1]
    assert last.loss < 0.8 * first.loss and last.accept_len > first.accept_len + 0.2, (first, last)


def test_saved_checkpoint_layout_and_shared_heads(target, data_file, tmp_path):
    """The published layout (config fields, unprefixed tensor names, no embeddings / lm_head) loads strictly;
    the target's embeddings stay untouched by training."""
    embed_before = target.embed_tokens.clone()
    train_dflash(target, data_file, tmp_path / "d", num_layers=2, block_size=4, target_layer_ids=[0, 3], steps=2,
                 batch_size=2, anchors_per_seq=2, max_len=MAX_LEN, val_frac=0.0, progress=False)
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["block_size"] == 4
    assert raw["dflash_config"] == {"mask_token_id": 159, "target_layer_ids": [0, 3]}
    assert raw["layer_types"] == [FULL, FULL] and raw["num_target_layers"] == 4
    from safetensors import safe_open

    with safe_open(str(tmp_path / "d" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "fc.weight" in names and "layers.1.self_attn.q_proj.weight" in names
    assert not any("embed" in n or "lm_head" in n for n in names)
    loaded = load_dflash_drafter(tmp_path / "d", target, target.config, "cpu", torch.float32, max_len=MAX_LEN)
    assert loaded.fc.shape == (64, 2 * 64)
    assert torch.equal(target.embed_tokens, embed_before) and not target.embed_tokens.requires_grad


def test_training_continues_from_a_saved_drafter(target, data_file, tmp_path):
    """--init-from starts from the saved drafter (step-0 validation equals the saved step's) and keeps its
    shape, whatever the other shape arguments say; a larger --num-layers grows it without changing what it
    computes at step 0; fewer layers is an error."""
    kwargs = dict(batch_size=8, anchors_per_seq=8, lr=3e-3, max_len=MAX_LEN, val_frac=0.2, progress=False)
    first = train_dflash(target, data_file, tmp_path / "a", num_layers=1, block_size=4, steps=60, **kwargs)
    more = train_dflash(target, data_file, tmp_path / "b", block_size=8, steps=60, init_from=tmp_path / "a", **kwargs)
    saved = next(v for v in first.validations if v.step == first.saved_step)
    assert more.validations[0].loss == pytest.approx(saved.loss, rel=1e-5)
    assert len(more.drafter.layers) == 1 and more.drafter.config.block_size == 4
    assert more.validations[-1].loss < first.validations[0].loss
    grown = train_dflash(target, data_file, tmp_path / "g", num_layers=3, steps=60, init_from=tmp_path / "a", **kwargs)
    assert len(grown.drafter.layers) == 3
    assert json.loads((tmp_path / "g" / "config.json").read_text())["num_hidden_layers"] == 3
    assert grown.validations[0].loss == pytest.approx(saved.loss, rel=1e-5)
    assert grown.validations[-1].loss < grown.validations[0].loss
    with pytest.raises(ValueError, match="not shrink"):
        train_dflash(target, data_file, tmp_path / "s", num_layers=1, steps=1, init_from=tmp_path / "g", **kwargs)
    with pytest.raises(CheckpointError):
        train_dflash(target, data_file, tmp_path / "c", num_layers=1, steps=1, init_from=tmp_path / "nope", **kwargs)


def test_default_mask_token_skips_chat_and_special_ids():
    class Tok:
        mask_token_id = None
        bos_token_id, eos_token_id, pad_token_id, unk_token_id = 1, 2, 2, 0
        added_tokens_decoder = {0: "<unk>", 1: "<s>", 2: "</s>", 3: "<a>", 4: "<b>", 5: "<c>"}

        def apply_chat_template(self, chat, tokenize):
            return [1, 5, 9, 2]  # the template itself uses <c>

    assert default_mask_token_id(Tok(), 160) == 4
    assert default_mask_token_id(None, 160) == 159
    Tok.mask_token_id = 7
    assert default_mask_token_id(Tok(), 160) == 7


def test_unknown_schedule_fails_before_the_target_loads(tmp_path, data_file):
    with pytest.raises(ValueError, match="schedule must be one of"):
        train_dflash(tmp_path / "no-such-target", data_file, tmp_path / "d", schedule="linear", progress=False)


def test_cli_trains_from_a_checkpoint_directory(tmp_path, data_file, monkeypatch):
    """`main` loads a target directory (HF layout, with its tokenizer for the mask default) and saves a drafter."""
    monkeypatch.setenv("DFLASH_TFM_COMPILE", "0")  # main() sets it for its process; keep it out of the others
    path = save_tiny_chat_model(tmp_path)
    out = tmp_path / "drafter"
    rc = main(["--model-path", str(path), "--data", str(data_file), "--out", str(out), "--num-layers", "1",
               "--block-size", "4", "--steps", "2", "--batch-size", "2", "--anchors-per-seq", "2", "--max-len", "48",
               "--device", "cpu", "--val-frac", "0.1", "--schedule", "constant", "--no-progress"])
    assert rc == 0
    assert json.loads((out / "config.json").read_text())["dflash_config"]["mask_token_id"] == 4  # <extra>, unused
    logged = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [e["lr"] for e in logged if "lr" in e][-1] == pytest.approx(6e-4)  # held at the peak to the end
    assert main(["--model-path", str(path), "--data", str(tmp_path / "missing.jsonl"), "--out", str(out),
                 "--device", "cpu", "--no-progress"]) == 2
