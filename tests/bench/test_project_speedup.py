"""The 27B speed projection: tok/s = 1000 · τ / step ms and speedup over the same run's AR step, computed from small
step-time and acceptance files written here (so every expected number is worked out by hand below); user τ over
file τ; a mode with only one of the two numbers is a note, not a row; unusable inputs exit 2 with one line; and
the committed docs/data files project DFLASH, DDTREE 64 and DFLASH_TFM 64."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.project_speedup import main

REPO = Path(__file__).resolve().parents[2]


def step_file(path: Path, ar_ms: float, step_ms: dict[str, float]) -> Path:
    """A file shaped as bench_spec_step --out writes it (phase times irrelevant here)."""
    modes = {name: {"draft": 1.0, "tree": 0.5, "verify": ms - 2.0, "commit": 0.5, "step_ms": ms, "nodes": 65}
             for name, ms in step_ms.items()}
    path.write_text(json.dumps({"context": 1024, "ar_step_ms": ar_ms, "modes": modes}))
    return path


def tau_file(path: Path, rows: list[tuple[str, str, float, int | None, float]]) -> Path:
    """Lines as measure_acceptance writes them: (dataset, algorithm, temperature, budget, τ), DFLASH_TFM at 16."""
    path.write_text("".join(json.dumps({"dataset": d, "algorithm": a, "temperature": t, "budget": b, "tau": tau,
                                        "prompts": 20, **({"children_per_node": 16} if a == "DFLASH_TFM" else {})})
                            + "\n" for d, a, t, b, tau in rows))
    return path


@pytest.fixture
def inputs(tmp_path: Path) -> tuple[Path, Path]:
    steps = step_file(tmp_path / "spec.json", 15.0, {"DFLASH": 20.0, "DDTREE 64": 25.0, "DDTREE 128": 30.0,
                                                     "DFLASH_TFM 64 c16": 24.0})
    taus = tau_file(tmp_path / "tau.jsonl", [
        ("gsm8k", "DFLASH", 0.0, None, 3.5), ("mtbench", "DFLASH", 0.0, None, 2.5),  # macro 3.0
        ("gsm8k", "DDTREE", 0.0, 64, 4.0), ("mtbench", "DDTREE", 0.0, 64, 3.0),  # macro 3.5
        ("gsm8k", "DDTREE", 0.0, 32, 3.2), ("mtbench", "DDTREE", 0.0, 32, 2.8),  # no step time
        ("gsm8k", "DFLASH_TFM", 0.0, 64, 6.0), ("mtbench", "DFLASH_TFM", 0.0, 64, 4.0),  # macro 5.0
        ("gsm8k", "DFLASH", 1.0, None, 9.0)])  # another temperature: ignored
    return steps, taus


def project(capsys: pytest.CaptureFixture, tmp_path: Path, *argv: str) -> tuple[dict, str]:
    out = tmp_path / "proj.json"
    main(["--gpu", "TestGPU", *argv, "--out", str(out)])
    return json.loads(out.read_text()), capsys.readouterr().out


def by_mode(result: dict) -> dict[tuple[str, int | None], dict]:
    return {(r["algorithm"], r["budget"]): r for r in result["rows"]}


def test_projected_numbers_notes_and_labels(inputs, tmp_path, capsys) -> None:
    steps, taus = inputs
    result, text = project(capsys, tmp_path, "--step-times", str(steps), "--acceptance", str(taus))
    rows = by_mode(result)
    assert rows[("AR", None)]["tok_s"] == pytest.approx(1000 / 15) and rows[("AR", None)]["speedup"] == 1.0
    dflash = rows[("DFLASH", None)]  # τ 3.0 at 20 ms: 150 tok/s, 150 / 66.67 = 2.25
    assert dflash["tau"] == pytest.approx(3.0) and dflash["tau_source"] == "file, 2 sets"
    assert dflash["tok_s"] == pytest.approx(150.0) and dflash["speedup"] == pytest.approx(2.25)
    assert rows[("DDTREE", 64)]["tok_s"] == pytest.approx(140.0)  # 3.5 at 25 ms
    assert rows[("DFLASH_TFM", 64)]["speedup"] == pytest.approx(5.0 * 15 / 24)
    assert ("DDTREE", 128) not in rows and ("DDTREE", 32) not in rows
    assert "DDTREE 128: step time [1] but no τ at T = 0: no row" in result["notes"]
    assert "DDTREE 32: τ (file) but no step time in the step-time files: no row" in result["notes"]
    assert text.startswith("PROJECTION, not a measurement: step times measured on TestGPU at 27B shapes with random "
                           f"weights (files [1] {steps}), τ from 1 measure_acceptance files at T = 0")
    assert "| AR | – | 1.00 | definition | 15.00 | 66.67 | 1.00× |  |" in text
    assert "| DFLASH | – | 3.00 | file, 2 sets | 20.00 | 150.00 | 2.25× |  |" in text
    assert result["step_time_files"] == [str(steps)] and result["acceptance_files"] == [str(taus)]


def test_user_tau_overrides_files_and_marks_the_best_budget(inputs, tmp_path, capsys) -> None:
    steps, taus = inputs
    result, text = project(capsys, tmp_path, "--step-times", str(steps), "--acceptance", str(taus),
                           "--tau", "DFLASH=6.5", "DDTREE=4.5", "DDTREE:64=5.0", "DFLASH_TFM:32=9")
    rows = by_mode(result)
    assert rows[("DFLASH", None)]["tau"] == 6.5 and rows[("DFLASH", None)]["tau_source"] == "user"
    assert rows[("DDTREE", 64)]["tau"] == 5.0  # the budget's own value over the algorithm's
    assert rows[("DDTREE", 128)]["tok_s"] == pytest.approx(150.0)  # DDTREE=4.5 at 30 ms
    assert rows[("DDTREE", 64)]["best"] and not rows[("DDTREE", 128)]["best"]  # 200 tok/s vs 150
    assert not rows[("DFLASH", None)]["best"]  # one budget: nothing to choose
    assert rows[("DFLASH_TFM", 64)]["tau_source"] == "file, 2 sets"
    assert "DFLASH: user τ 6.50 over the files' 3.00" in result["notes"]
    assert "--tau DFLASH_TFM 32: matches no mode of the step-time files" in result["notes"]
    assert "| DDTREE | 64 | 5.00 | user | 25.00 | 200.00 | 3.00× | best |" in text
    assert ("τ from 1 measure_acceptance files at T = 0, macro average over gsm8k, mtbench and the user: DFLASH=6.5"
            in text)


def test_user_tau_alone_and_runs_of_several_files(tmp_path, capsys) -> None:
    """Each mode takes its speedup from the AR step of the run it was timed in; a later file's mode wins."""
    first = step_file(tmp_path / "a.json", 15.0, {"DFLASH": 20.0, "DDTREE 16": 18.0})
    second = step_file(tmp_path / "b.json", 12.0, {"DFLASH": 16.0, "DFLASH_TFM 64 c8": 24.0})
    result, text = project(capsys, tmp_path, "--step-times", str(first), str(second),
                           "--tau", "DFLASH=3", "DDTREE:16=2.7", "DFLASH_TFM c8=4")
    rows = by_mode(result)
    assert rows[("DFLASH", None)]["run"] == 1 and rows[("DFLASH", None)]["speedup"] == pytest.approx(3 * 12 / 16)
    assert rows[("DDTREE", 16)]["speedup"] == pytest.approx(2.7 * 15 / 18)
    assert rows[("DFLASH_TFM c8", 64)]["tok_s"] == pytest.approx(4000 / 24)
    assert [r["step_ms"] for r in result["rows"] if r["algorithm"] == "AR"] == [15.0, 12.0]
    assert "DFLASH: step time from [2], not [1]" in result["notes"]
    assert "| DFLASH | – | 3.00 | user | 16.00 | 187.50 | 2.25× | [2] |  |" in text
    assert "τ from the user: DFLASH=3 DDTREE:16=2.7 DFLASH_TFM c8=4." in text


@pytest.mark.parametrize("tau, message", [
    ("DFLASH6.5", "expected ALGO[:BUDGET]=VALUE"), ("EAGLE=3", "expected ALGO[:BUDGET]=VALUE"),
    ("DDTREE:64=fast", "'fast' is not a number"), ("DFLASH:64=3", "DFLASH has no tree budget"),
    ("DDTREE:64=0.5", "at least 1"), ("DDTREE c8:64=3", "only DFLASH_TFM has a width")])
def test_bad_tau_exits_2_with_one_line(inputs, tmp_path, capsys, tau: str, message: str) -> None:
    steps, _ = inputs
    with pytest.raises(SystemExit) as e:
        main(["--gpu", "TestGPU", "--step-times", str(steps), "--tau", tau])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: --tau") and message in err and err.count("\n") == 1


def test_other_unusable_inputs_exit_2(inputs, tmp_path, capsys) -> None:
    steps, taus = inputs
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    unknown = step_file(tmp_path / "unknown.json", 15.0, {"DDTREE": 20.0})
    cases = [(["--step-times", str(tmp_path / "missing.json"), "--tau", "DFLASH=3"], "no such file: "),
             (["--step-times", str(broken), "--tau", "DFLASH=3"], "not a bench_spec_step JSON file"),
             (["--step-times", str(unknown), "--tau", "DDTREE=3"], "mode 'DDTREE' is not one bench_spec_step writes"),
             (["--step-times", str(steps), "--acceptance", str(tmp_path / "none.jsonl")], "none.jsonl"),
             (["--step-times", str(steps)], "give --acceptance files, --tau values or both"),
             (["--step-times", str(steps), "--acceptance", str(taus), "--temperature", "0.5"],
              "no mode has both a step time and a τ")]
    for argv, message in cases:
        with pytest.raises(SystemExit) as e:
            main(["--gpu", "TestGPU", *argv])
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err and err.count("\n") == 1, argv


def test_the_committed_measurements(tmp_path, capsys) -> None:
    """The H100 step times with every T = 0 τ cell: the three algorithms at budget 64 (the only budget timed)."""
    steps = REPO / "docs/data/perf/spec_step_h100_2026-12-05_renovated.json"
    taus = sorted((REPO / "docs/data/tau").glob("*.jsonl"))
    result, text = project(capsys, tmp_path, "--step-times", str(steps), "--acceptance", *map(str, taus))
    timed = json.loads(steps.read_text())
    rows = by_mode(result)
    assert set(rows) == {("AR", None), ("DFLASH", None), ("DDTREE", 64), ("DFLASH_TFM", 64)}
    for mode, name in [(("DFLASH", None), "DFLASH"), (("DDTREE", 64), "DDTREE 64"),
                       (("DFLASH_TFM", 64), "DFLASH_TFM 64 c16")]:
        row = rows[mode]
        assert row["tau_source"] == "file, 4 sets" and row["step_ms"] == timed["modes"][name]["step_ms"]
        assert row["speedup"] == pytest.approx(row["tau"] * timed["ar_step_ms"] / row["step_ms"])
    assert "DDTREE 32: τ (file) but no step time in the step-time files: no row" in result["notes"]
    assert text.startswith("PROJECTION, not a measurement: step times measured on TestGPU")
