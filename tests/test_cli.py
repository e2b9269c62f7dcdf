"""The `dflash-tfm` entry point: a real generation on the embedded model, and one-line errors."""
from __future__ import annotations

import subprocess
import sys

from dflash_tfm.cli import main


def test_generate_prints_text_and_speed() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_tfm.cli", "generate", "--chat", "--prompt", "Say hello.", "--max-new-tokens", "8",
         "--device", "cpu"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    assert "tok/s" in proc.stderr and "tau=1.00" in proc.stderr


def test_bad_model_path_is_one_line_error(capsys, tmp_path) -> None:
    assert main(["generate", "--prompt", "x", "--model-path", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "error: model path does not exist" in err and "nope" in err and "Traceback" not in err


def test_invalid_sampling_value_is_one_line_error(capsys) -> None:
    assert main(["generate", "--prompt", "x", "--temperature", "-1"]) == 2
    assert "temperature must be a number in [0, 100]" in capsys.readouterr().err


def test_serve_and_bench_subcommands_delegate_to_their_modules(capsys) -> None:
    import pytest

    for sub, marker in (("serve", "--speculative-dflash-tfm-tree-budget"), ("bench", "--per-dataset-limit")):
        with pytest.raises(SystemExit) as exc:
            main([sub, "--help"])
        assert exc.value.code == 0
        assert marker in capsys.readouterr().out


def test_subcommand_without_its_extra_names_the_install(monkeypatch, capsys) -> None:
    import importlib

    def missing(name: str):
        raise ModuleNotFoundError("No module named 'fastapi'", name="fastapi")

    monkeypatch.setattr(importlib, "import_module", missing)
    assert main(["serve", "--port", "1"]) == 2
    assert "pip install 'dflash-tfm[server]'" in capsys.readouterr().err
