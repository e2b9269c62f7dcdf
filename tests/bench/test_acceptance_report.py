"""The acceptance report: cells by (temperature, budget, algorithm), unusual prompt counts shown, and the
issue's ordering check saying NO when the order breaks."""
import json
from pathlib import Path

from benchmarks.acceptance_report import ordering, read_cells, table


def write(path: Path, rows: list[tuple[str, str, float, int | None, float, int]]) -> None:
    """Rows as measure_acceptance writes them (DFLASH_TFM ones at the default width)."""
    path.write_text("".join(json.dumps({"dataset": d, "algorithm": a, "temperature": t, "budget": b, "tau": tau,
                                        "prompts": n, **({"children_per_node": 16} if a == "DFLASH_TFM" else {})})
                            + "\n" for d, a, t, b, tau, n in rows))


def test_table_and_ordering(tmp_path: Path) -> None:
    write(tmp_path / "a.jsonl", [("gsm8k", "DFLASH", 0.0, None, 1.5, 20), ("gsm8k", "DDTREE", 0.0, 64, 2.0, 20),
                                 ("gsm8k", "DFLASH_TFM", 0.0, 64, 2.5, 20), ("mtbench", "DFLASH", 0.0, None, 1.4, 20)])
    write(tmp_path / "b.jsonl", [("mtbench", "DDTREE", 0.0, 64, 1.3, 5), ("mtbench", "DFLASH_TFM", 0.0, 64, 1.6, 20)])
    cells = read_cells([tmp_path / "a.jsonl", tmp_path / "b.jsonl"])
    md = table(cells, ["gsm8k", "mtbench"])
    assert "| 0 | 64 | DDTREE | 2.00 | 1.30 (n=5) | 1.65 |" in md
    assert "| 0 | – | DFLASH | 1.50 | 1.40 | 1.45 |" in md
    checks = ordering(cells, ["gsm8k", "mtbench"], 0.0, 64)
    assert checks[0].endswith("yes; TFM / DFLASH = 1.67") and "NO" in checks[1]  # DDTREE 1.3 < DFLASH 1.4


def test_a_wider_weaver_tree_is_its_own_row(tmp_path: Path) -> None:
    """Rows measured with a non-default DFLASH_TFM width (children_per_node; rows without the field were
    measured at the old default, 8) neither overwrite nor merge with the default (16) cell."""
    rows = [{"dataset": "gsm8k", "algorithm": "DFLASH_TFM", "temperature": 1.0, "budget": 64, "tau": 1.8, "prompts": 20},
            {"dataset": "gsm8k", "algorithm": "DFLASH_TFM", "temperature": 1.0, "budget": 64, "tau": 2.0, "prompts": 20,
             "children_per_node": 16}]
    (tmp_path / "w.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    md = table(read_cells([tmp_path / "w.jsonl"]), ["gsm8k"])
    assert "| 1 | 64 | DFLASH_TFM c8 | 1.80 | 1.80 |" in md and "| 1 | 64 | DFLASH_TFM | 2.00 | 2.00 |" in md


def test_expected_tau_follows_in_brackets(tmp_path: Path) -> None:
    rows = [{"dataset": d, "algorithm": "DDTREE", "temperature": 1.0, "budget": 64, "tau": tau, "prompts": 20,
             "expected_tau": expected} for d, tau, expected in (("gsm8k", 2.0, 2.1), ("mtbench", 1.5, 1.4))]
    (tmp_path / "e.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    md = table(read_cells([tmp_path / "e.jsonl"]), ["gsm8k", "mtbench"])
    assert "| 1 | 64 | DDTREE | 2.00 [2.10] | 1.50 [1.40] | 1.75 [1.75] |" in md
