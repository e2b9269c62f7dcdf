"""Saved tap features (`gen-data --save-taps`, `train-dflash --tap-features`): the file holds exactly the target's
tap outputs of every row (oracle: `TargetFeatures` over each row alone), training from it equals training with the
features computed, and files that do not fit the data or the drafter are refused with the reason."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash_tfm.train.data import main as data_main
from dflash_tfm.train.dflash_trainer import train_dflash
from dflash_tfm.train.rows import read_rows
from dflash_tfm.train.tap_file import SavedTapFeatures
from dflash_tfm.train.target_features import TargetFeatures
from tests.train.tiny_chat import save_tiny_chat_model

TAPS = [0, 1]


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(model dir, rows file, tap file) from the gen-data CLI on a tiny chat checkpoint."""
    root = tmp_path_factory.mktemp("taps")
    model_dir = save_tiny_chat_model(root / "model")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"key": f"syn:{i}", "text": t, "source": "syn"}) + "\n"
                               for i, t in enumerate(["hello world", "how many eggs", "two plus three", "what is"])))
    rows, taps = root / "rows.jsonl", root / "rows.taps.safetensors"
    assert data_main(["--model-path", str(model_dir), "--out", str(rows), "--prompts-file", str(prompts),
                      "--max-new-tokens", "6", "--device", "cpu", "--dtype", "float32", "--max-model-len", "128",
                      "--save-taps", str(taps), "--tap-layer-ids", *map(str, TAPS), "--no-progress"]) == 0
    return model_dir, rows, taps


def test_saved_taps_are_the_targets_outputs_of_every_row(generated) -> None:
    model_dir, rows_path, taps_path = generated
    from dflash_tfm.loading.loader import load_target

    model = load_target(model_dir, torch.device("cpu"), torch.float32, progress=False).model
    rows = read_rows(rows_path, max_len=1 << 30)
    saved = SavedTapFeatures(taps_path)
    assert saved.tap_layer_ids == TAPS and saved.row_ids == [r.key for r in rows] and len(rows) == 4
    store = saved.store([r.key for r in rows], [r.tokens for r in rows], torch.device("cpu"))
    features = TargetFeatures(model, TAPS, 128)
    for row in rows:
        want = features(torch.tensor([row.tokens]))[0]
        _, got = store.gather([row.tokens], len(row.tokens))
        assert torch.allclose(got[0], want, rtol=1e-5, atol=1e-5)


def test_training_from_saved_taps_equals_computing_them(generated, tmp_path) -> None:
    model_dir, rows_path, taps_path = generated
    kwargs = dict(num_layers=1, block_size=4, target_layer_ids=TAPS, steps=4, batch_size=2, anchors_per_seq=2,
                  max_len=24, val_frac=0.25, log_every=1, eval_every=2, device="cpu", dtype="float32", progress=False)
    computed = train_dflash(model_dir, rows_path, tmp_path / "a", **kwargs)
    from_file = train_dflash(model_dir, rows_path, tmp_path / "b", tap_features=taps_path, **kwargs)
    assert [e["loss"] for e in from_file.log] == pytest.approx([e["loss"] for e in computed.log], rel=1e-5)


def test_files_that_do_not_fit_are_refused(generated, tmp_path) -> None:
    model_dir, rows_path, taps_path = generated
    kwargs = dict(num_layers=1, block_size=4, steps=1, batch_size=2, max_len=24, device="cpu", dtype="float32",
                  progress=False)
    with pytest.raises(ValueError, match=r"holds taps \[0, 1\]"):
        train_dflash(model_dir, rows_path, tmp_path / "d", target_layer_ids=[1, 2], tap_features=taps_path, **kwargs)
    with pytest.raises(ValueError, match="final hidden states"):
        train_dflash(model_dir, rows_path, tmp_path / "d", target_layer_ids=TAPS, tap_features=taps_path,
                     distill=True, **kwargs)
    other = tmp_path / "other.jsonl"
    row = json.loads(rows_path.read_text().splitlines()[0])
    other.write_text(json.dumps(dict(row, id="syn:elsewhere")) + "\n" + rows_path.read_text())
    with pytest.raises(ValueError, match="no features for row 'syn:elsewhere'"):
        train_dflash(model_dir, other, tmp_path / "d", target_layer_ids=TAPS, tap_features=taps_path, **kwargs)
    with pytest.raises(FileNotFoundError, match="not found"):
        SavedTapFeatures(tmp_path / "missing.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a tap feature file"):
        SavedTapFeatures(tmp_path / "junk.safetensors")
    assert data_main(["--model-path", str(model_dir), "--out", str(rows_path), "--prompts-file", str(tmp_path / "x"),
                      "--device", "cpu", "--no-progress"]) == 2  # (a missing prompts file: the CLI's clear error)
