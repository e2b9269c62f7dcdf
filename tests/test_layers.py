"""The package's imports point down only: the layers contract in pyproject.toml ([tool.importlinter]), checked
with import-linter as `lint-imports` does in CI. A module that imports from a layer above it (or a new top-level
module that no layer declares) fails here, naming the import."""
from __future__ import annotations

import logging
from pathlib import Path

from importlinter.cli import lint_imports

ROOT = Path(__file__).parents[1]


def test_imports_follow_the_layers_contract(capsys) -> None:
    # lint_imports configures logging with dictConfig, which disables every logger that exists; tests run after
    # this one still read the package's log lines, so the loggers enabled before are enabled again.
    loggers = logging.Logger.manager.loggerDict.values()
    enabled = [lg for lg in loggers if isinstance(lg, logging.Logger) and not lg.disabled]
    try:
        code = lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True)
    finally:
        for lg in enabled:
            lg.disabled = False
    assert code == 0, capsys.readouterr().out
