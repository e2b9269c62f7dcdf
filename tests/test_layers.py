"""The package's imports point down only: the layers contract in pyproject.toml ([tool.importlinter]), checked
with import-linter as `lint-imports` does in CI. A module that imports from a layer above it (or a new top-level
module that no layer declares) fails here, naming the import."""
from __future__ import annotations

from pathlib import Path

from importlinter.cli import lint_imports

ROOT = Path(__file__).parents[1]


def test_imports_follow_the_layers_contract(capsys) -> None:
    code = lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True)
    assert code == 0, capsys.readouterr().out
