"""`dflash-tfm demo` end to end on the embedded SmolLM2 with a random bundle (tiny sizes), and the bundle lookup
that decides which algorithms run."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dflash_tfm.demo import (
    ALGORITHMS, DEFAULT_BUNDLE, UNTRAINED, Cell, find_bundle, load_demo_prompts, main, summarize,
)


@pytest.fixture
def single_thread() -> Iterator[None]:
    """One intra-op thread: on a shared 2-core runner two threads wait on each other and run 5-10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_demo_runs_all_algorithms_with_random_bundle(capsys, tmp_path: Path, single_thread: None) -> None:
    out = tmp_path / "demo.json"
    code = main(["--random-bundle", "--device", "cpu", "--datasets", "gsm8k", "mtbench", "--prompts-per-dataset", "1",
                 "--max-new-tokens", "8", "--budget", "16", "--max-model-len", "512", "--json", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "untrained" in text and "Macro Avg" in text and "gsm8k" in text and "mtbench" in text
    for algo in ALGORITHMS:
        assert algo in text
    rows = json.loads(out.read_text())["rows"]
    assert [(r["dataset"], r["algorithm"]) for r in rows] == [
        (d, a) for d in ("gsm8k", "mtbench", "Macro Avg") for a in ALGORITHMS]
    for r in rows:
        assert r["prompts"] >= 1 and r["tokens"] >= 1 and r["tau"] >= 1.0 and r["tok_s"] > 0
        assert r["speedup"] > 0 and (r["algorithm"] != "AR" or abs(r["speedup"] - 1.0) < 1e-9)
        if r["algorithm"] == "AR":
            assert r["verify_ms"] is None and r["sizes"] == "-"
        else:  # where a speculative step's time goes, and the fixed proposal size every step took
            assert r["verify_ms"] > 0 and r["draft_ms"] > 0 and r["commit_ms"] > 0
            assert r["sizes"] == ("15:100%" if r["algorithm"] == "DFLASH" else "16:100%")


def test_demo_auto_budget_shows_sizes_and_repeat_check(capsys, tmp_path: Path, single_thread: None) -> None:
    """The default budget is "auto": sizes are measured at start and chosen per step; the table names them, and
    --repeat-check times every cell twice and says how far apart the passes are."""
    out = tmp_path / "demo.json"
    code = main(["--random-bundle", "--device", "cpu", "--datasets", "gsm8k", "--prompts-per-dataset", "1",
                 "--max-new-tokens", "8", "--max-model-len", "512", "--repeat-check", "--json", str(out)])
    assert code == 0
    text = " ".join(capsys.readouterr().out.split())  # the table's title wraps with the terminal's width
    assert "budget auto" in text and "first vs repeated timed pass: largest difference" in text
    data = json.loads(out.read_text())
    for r in data["rows"]:
        if r["algorithm"] != "AR":
            sizes = dict(part.split(":") for part in r["sizes"].split())
            assert sizes and all(int(size) >= 0 for size in sizes)
    assert all(c["repeat_seconds"] > 0 for c in data["cells"])


def test_missing_bundle_means_ar_only_with_a_clear_note(tmp_path: Path) -> None:
    bundle, notes = find_bundle(tmp_path)
    assert bundle.algorithms() == ["AR"]
    assert len(notes) == 1 and "no trained bundle" in notes[0] and "--random-bundle" in notes[0]
    (tmp_path / "dflash").mkdir()
    (tmp_path / "dflash" / "config.json").write_text("{}")
    bundle, notes = find_bundle(tmp_path)
    assert bundle.algorithms() == ["AR", "DFLASH", "DDTREE"] and "DFLASH_TFM skipped" in notes[0]
    (tmp_path / "weaver.pth").write_bytes(b"")
    bundle, notes = find_bundle(tmp_path)
    assert bundle.algorithms() == list(ALGORITHMS) and notes == [] and bundle.label != UNTRAINED
    assert DEFAULT_BUNDLE.parts[-2:] == ("assets", "smollm2_bundle")


def test_summary_speedup_and_macro_average() -> None:
    cells = [Cell("a", "AR", 10, 1.0, [1.0]), Cell("a", "DFLASH", 10, 0.5, [2.0, 4.0]),
             Cell("b", "AR", 30, 1.0, [1.0]), Cell("b", "DFLASH", 30, 2.0, [1.0])]
    rows = {(r["dataset"], r["algorithm"]): r for r in summarize(cells)}
    assert rows["a", "DFLASH"]["speedup"] == 2.0 and rows["a", "DFLASH"]["tau"] == 3.0
    macro = rows["Macro Avg", "DFLASH"]
    assert macro["tok_s"] == (20.0 + 15.0) / 2 and macro["speedup"] == 17.5 / 20.0 and macro["tau"] == 2.0


def test_unavailable_dataset_is_a_one_line_note(tmp_path: Path) -> None:
    prompts, notes = load_demo_prompts(["gsm8k", "mbpp"], 2, tmp_path)  # mbpp has no offline source
    assert list(prompts) == ["gsm8k"] and len(prompts["gsm8k"]) == 2
    assert len(notes) == 1 and notes[0].startswith("skip mbpp:") and "\n" not in notes[0]


def test_committed_bundle_is_complete_and_within_30_mb() -> None:
    """Drafter + Weaver together stay <= 30 MB (they ride in the package), committed and found by the demo's own
    lookup."""
    bundle, notes = find_bundle(DEFAULT_BUNDLE)
    weights = [DEFAULT_BUNDLE / "dflash" / "model.safetensors", DEFAULT_BUNDLE / "weaver.pth"]
    assert bundle is not None and not notes and all(p.is_file() for p in weights)
    assert sum(p.stat().st_size for p in weights) <= 30_000_000
