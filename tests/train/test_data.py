"""Training data: the prompt sources never hand out evaluation prompts, and generation writes, resumes and
shards JSONL rows equal to what the engine itself generates for the same prompts.

Oracles: the benchmark loaders (`dflash_tfm.bench.datasets`) for what counts as an evaluation prompt;
`Engine.encode_prompt` / `Engine.generate` for the rows. Generation runs a tiny random chat checkpoint
(tests/train/tiny_chat.py) through the real engine, to keep CPU time small.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from dflash_tfm import Engine, SamplingParams
from dflash_tfm.bench.datasets import DatasetUnavailable, load_prompts, prepare_dataset
from dflash_tfm.train.data import generate_training_data, main
from dflash_tfm.train.prompts import (
    CODE_HINT,
    EVALUATION_SETS,
    SHARECHAT_HOLDOUT,
    SOURCES,
    TrainingPrompt,
    gsm8k_train_prompts,
    read_prompts,
    training_prompts,
)
from dflash_tfm.train.prompts import main as prompts_main
from tests.train.tiny_chat import save_tiny_chat_model

PROMPTS = [TrainingPrompt(f"syn:{i}", text, "syn")
           for i, text in enumerate(["hello world", "how many eggs", "two plus three is what", "what is hello"])]


def norm(text: str) -> str:
    return " ".join(re.findall(r"\w+", text.lower()))


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many tiny decode steps on shared cores
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"))


@pytest.fixture(scope="module")
def engine(model_dir) -> Engine:
    return Engine(model_dir, device="cpu", dtype="float32", max_model_len=128, progress=False)


@pytest.fixture(scope="module")
def mixture() -> list[TrainingPrompt]:
    try:
        return training_prompts()
    except DatasetUnavailable as e:
        pytest.skip(f"training prompt sources not installed: {e}")


# ---- prompt sources ------------------------------------------------------------------------------------


def test_training_prompts_are_disjoint_from_evaluation_sets(mixture):
    texts = {norm(p.text) for p in mixture}
    checked = []
    for name in EVALUATION_SETS:
        try:
            prompts = load_prompts(name)[0]
        except DatasetUnavailable:
            continue
        assert not texts & {norm(p.text) for p in prompts}, name
        checked.append(name)
    assert "gsm8k" in checked  # ../shared/datasets/gsm8k_test.jsonl is always there
    for cap in (None, SHARECHAT_HOLDOUT):  # the harness's default sharechat sample, and the largest held out
        bench = prepare_dataset("sharechat", limit=cap)
        assert not texts & {norm(p.text) for p in bench.prompts}


def test_mixture_is_balanced_and_labelled(mixture):
    assert [p.source for p in mixture[:3]] == list(SOURCES)
    assert len({p.key for p in mixture}) == len(mixture)
    by_source = {s: [p for p in mixture if p.source == s] for s in SOURCES}
    assert all(CODE_HINT.search(p.text) for p in by_source["sharegpt_code"])
    assert not any(CODE_HINT.search(p.text) for p in by_source["sharegpt"])
    # GSM8K train holds a few near-copies of test questions (shared 13-word windows): dropped.
    assert 7400 < len(by_source["gsm8k_train"]) < len(gsm8k_train_prompts())


def test_gsm8k_train_path_override_and_missing_file(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"question": "How many eggs?", "answer": "2"}) + "\n")
    assert gsm8k_train_prompts(path) == [TrainingPrompt("gsm8k_train:0", "How many eggs?", "gsm8k_train")]
    with pytest.raises(DatasetUnavailable, match="--gsm8k-train"):
        gsm8k_train_prompts(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="unknown"):
        training_prompts(["gsm8k_test"])


# ---- generation -----------------------------------------------------------------------------------------


def test_rows_are_the_engines_own_generations(engine, tmp_path):
    """Batched generation (2 slots for 3 prompts) writes, per prompt, what `Engine.generate` gives alone."""
    out = tmp_path / "d.jsonl"
    summary = generate_training_data(engine, PROMPTS, out, max_new_tokens=5, limit=3, batch_size=2, progress=False)
    rows = {r["id"]: r for r in read(out)}
    assert summary.written == 3 and sorted(rows) == ["syn:0", "syn:1", "syn:2"]
    for prompt in PROMPTS[:3]:
        row, ids = rows[prompt.key], engine.encode_prompt(prompt.text, chat=True)
        assert row["prompt_ids"] == ids and row["source"] == "syn"
        assert row["response_ids"] == engine.generate(ids, SamplingParams(max_new_tokens=5)).token_ids
        assert 1 <= len(row["response_ids"]) <= 5


def test_resume_after_a_crash_mid_row(engine, tmp_path):
    """A run cut off mid-line resumes: complete rows are kept, the torn one is regenerated identically
    (greedy), and a finished file is left alone."""
    out = tmp_path / "d.jsonl"
    kwargs = dict(max_new_tokens=4, progress=False)
    generate_training_data(engine, PROMPTS, out, limit=3, **kwargs)
    first = out.read_text().splitlines(keepends=True)
    out.write_text(first[0] + first[1][:12])
    summary = generate_training_data(engine, PROMPTS, out, limit=4, **kwargs)
    assert (summary.resumed, summary.written) == (1, 3)
    lines = out.read_text().splitlines(keepends=True)
    assert lines[0] == first[0] and set(first) <= set(lines) and len(lines) == 4
    assert sorted(json.loads(line)["id"] for line in lines) == [p.key for p in PROMPTS]
    again = generate_training_data(engine, PROMPTS, out, limit=4, **kwargs)
    assert (again.resumed, again.written) == (4, 0) and out.read_text().splitlines(keepends=True) == lines


def test_rows_of_an_earlier_run_are_not_generated_again(engine, tmp_path):
    """`skip_ids_in` (an earlier run's files, sharded differently) counts its prompts as done."""
    earlier = tmp_path / "earlier.jsonl"
    generate_training_data(engine, PROMPTS[:2], earlier, max_new_tokens=2, progress=False)
    out = tmp_path / "d.jsonl"
    s = generate_training_data(engine, PROMPTS, out, max_new_tokens=2, limit=4, skip_ids_in=[earlier],
                               progress=False)
    assert (s.resumed, s.written) == (2, 2)
    assert sorted(r["id"] for r in read(out)) == sorted(p.key for p in PROMPTS[2:4])


def test_extra_samples_get_their_own_ids(engine, tmp_path):
    """`id_suffix` writes more samples of the same prompts beside the plain rows (ids key#suffix), resumable by
    those ids; a suffix without the separator is refused."""
    out = tmp_path / "d.jsonl"
    generate_training_data(engine, PROMPTS[:2], out, max_new_tokens=3, progress=False)
    s = generate_training_data(engine, PROMPTS[:2], out, max_new_tokens=3, temperature=1.0, seed=5,
                               id_suffix="#t1s1", progress=False)
    assert (s.resumed, s.written) == (0, 2)
    assert sorted(r["id"] for r in read(out)) == ["syn:0", "syn:0#t1s1", "syn:1", "syn:1#t1s1"]
    again = generate_training_data(engine, PROMPTS[:2], out, max_new_tokens=3, id_suffix="#t1s1", progress=False)
    assert (again.resumed, again.written) == (2, 0)
    for bad in ("t1s1", "#a#b"):
        with pytest.raises(ValueError, match="id_suffix"):
            generate_training_data(engine, PROMPTS[:2], out, id_suffix=bad, progress=False)


def test_long_prompts_are_skipped_and_shards_partition(engine, tmp_path):
    prompts = [PROMPTS[0], TrainingPrompt("syn:long", "hello " * 200, "syn"), *PROMPTS[1:]]
    ids = []
    for shard in range(2):
        path = tmp_path / f"s{shard}.jsonl"
        s = generate_training_data(engine, prompts, path, max_new_tokens=2, limit=3, max_prompt_tokens=64,
                                   num_shards=2, shard_index=shard, progress=False)
        assert s.too_long == 1
        ids.append(sorted(r["id"] for r in read(path)))
    assert ids == [["syn:0", "syn:2"], ["syn:1"]]
    with pytest.raises(ValueError, match="shard_index"):
        generate_training_data(engine, prompts, tmp_path / "x.jsonl", num_shards=2, shard_index=2)


def test_cli_prompts_file_then_generation(model_dir, tmp_path):
    """The prompts CLI drops a GSM8K TEST question slipped into the train file and writes the rest; the data
    CLI generates from that file (the way a machine without the prompt packages gets its prompts)."""
    try:
        test_question = load_prompts("gsm8k")[0][0].text
    except DatasetUnavailable as e:
        pytest.skip(str(e))
    train = tmp_path / "train.jsonl"
    questions = [test_question, "how many eggs", "two plus three"]
    train.write_text("".join(json.dumps({"question": q}) + "\n" for q in questions))
    prompts_file = tmp_path / "prompts.jsonl"
    assert prompts_main(["--out", str(prompts_file), "--sources", "gsm8k_train", "--gsm8k-train", str(train)]) == 0
    prompts = read_prompts(prompts_file)
    assert sorted(p.key for p in prompts) == ["gsm8k_train:1", "gsm8k_train:2"]
    out = tmp_path / "rows.jsonl"
    rc = main(["--model-path", str(model_dir), "--out", str(out), "--prompts-file", str(prompts_file),
               "--limit", "5", "--max-new-tokens", "3", "--device", "cpu", "--dtype", "float32", "--no-progress"])
    assert rc == 0
    rows = read(out)
    assert sorted(r["id"] for r in rows) == sorted(p.key for p in prompts)
    assert all(r["source"] == "gsm8k_train" and 1 <= len(r["response_ids"]) <= 3 for r in rows)
    assert main(["--model-path", str(model_dir), "--out", str(out), "--sources", "gsm8k_train",
                 "--gsm8k-train", str(tmp_path / "nope.jsonl"), "--no-progress"]) == 2
    # --sources filters a prompts file: no sharegpt prompt in it, so nothing is written
    other = tmp_path / "other.jsonl"
    assert main(["--model-path", str(model_dir), "--out", str(other), "--prompts-file", str(prompts_file),
                 "--sources", "sharegpt", "--device", "cpu", "--dtype", "float32", "--no-progress"]) == 0
    assert read(other) == []
