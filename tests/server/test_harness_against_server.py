"""The benchmark harness against the real server (embedded SmolLM2): four offline datasets, four prompts
each, the printed table, requests.jsonl / summary.json, and the speedup column from --baseline."""
from __future__ import annotations

import json

import pytest

from dflash_tfm.bench.harness import build_arg_parser, run
from dflash_tfm.loading.default_model import default_model_path

from . import ServerProcess, launch_server_process, shared_server

DATASETS = ["gsm8k", "mtbench", "humaneval", "math500"]


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    launch_server_process()
    return shared_server()


def test_harness_runs_four_datasets_against_the_server(server: ServerProcess, tmp_path, capsys) -> None:
    # The server names its model without a path, so the harness is given the tokenizer to format chats with.
    args = build_arg_parser().parse_args([
        "--base-url", server.base_url, "--tokenizer-path", str(default_model_path()), "--datasets", *DATASETS, "--per-dataset-limit", "4",
        "--max-new-tokens", "8", "--temperature", "0", "--reasoning", "off", "--warmup-requests", "0",
        "--output-dir", str(tmp_path), "--baseline", *(f"{d}=10.0" for d in DATASETS),
    ])
    summary = run(args)
    table = capsys.readouterr().out
    assert "chat template of" in table  # the GGUF's own template
    rows = {r["dataset"]: r for r in summary["datasets"]}
    assert sorted(rows) == sorted(DATASETS) and not summary["unavailable"]
    for name, row in rows.items():
        assert row["prompts"] == 4 and row["errors"] == 0, row
        assert row["accept_length"] == pytest.approx(1.0)  # autoregressive: one token per target step
        assert row["speedup"] == pytest.approx(row["tok_s_per_seq"] / 10.0)
        assert name in table
    assert "Macro Avg" in table
    records = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert len(records) == 16 and all(0 < r["tokens"] <= 8 and r["steps"] == r["tokens"] for r in records)
    assert json.loads((tmp_path / "summary.json").read_text())["macro_avg"]["speedup"] is not None
