"""Turn `measure_acceptance` JSON lines into the acceptance table (markdown) and a bar plot of τ.

Rows: (temperature, budget) × algorithm; columns: datasets and their macro average (over the datasets
the algorithm has a cell for, which the table states); cells on an unusual number of prompts show it; the
ordering check (DFLASH < DDTREE < DFLASH_TFM per cell) at the end.

    python -m benchmarks.acceptance_report tau/*.jsonl --plot docs/acceptance_smollm2.png
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

ORDER = ("AR", "DFLASH", "DDTREE", "DFLASH_TFM")


TFM_CHILDREN = 16  # the engine's default DFLASH_TFM width (spec.weaver_tree.DEFAULT_CHILDREN_PER_NODE)


def label(row: dict) -> str:
    """The algorithm, with a non-default DFLASH_TFM tree width appended ("DFLASH_TFM c8"). Rows without the
    field were measured before it was recorded, all at the then default of 8."""
    if row["algorithm"] != "DFLASH_TFM":
        return row["algorithm"]
    children = row.get("children_per_node", 8)
    return row["algorithm"] if children == TFM_CHILDREN else f"{row['algorithm']} c{children}"


def order(name: str) -> int:
    return ORDER.index(name.split()[0])


def read_cells(paths: list[Path]) -> dict[tuple[float, int | None, str], dict[str, dict]]:
    """(temperature, budget, algorithm) -> dataset -> row; a later row for the same cell wins."""
    cells: dict[tuple[float, int | None, str], dict[str, dict]] = defaultdict(dict)
    for path in paths:
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                row = json.loads(line)
                cells[(row["temperature"], row["budget"], label(row))][row["dataset"]] = row
    return cells


def cell_text(row: dict, usual: int) -> str:
    """τ, its exact expectation in brackets where measured ("2.14 [2.11]"), and the prompt count if unusual."""
    expected = "" if row.get("expected_tau") is None else f" [{row['expected_tau']:.2f}]"
    return f"{row['tau']:.2f}{expected}" + ("" if row["prompts"] == usual else f" (n={row['prompts']})")


def table(cells: dict, datasets: list[str]) -> str:
    """Markdown; a cell measured on another number of prompts than most says so: "2.02 (n=5)"; the exact
    expected τ given the verified trees follows in brackets where the run measured it."""
    counts = [row["prompts"] for per in cells.values() for row in per.values()]
    usual = max(set(counts), key=counts.count)
    lines = ["| T | budget | algorithm | " + " | ".join(datasets) + " | macro avg |",
             "|---|---|---|" + "---|" * (len(datasets) + 1)]
    keys = sorted(cells, key=lambda k: (k[0], -(k[1] or 10**9), order(k[2]), k[2]))
    for temperature, budget, algorithm in keys:
        per = cells[(temperature, budget, algorithm)]
        taus = [per[d]["tau"] for d in datasets if d in per]
        macro = f"{sum(taus) / len(taus):.2f}" + ("" if len(taus) == len(datasets) else f" ({len(taus)} sets)")
        expected = [per[d].get("expected_tau") for d in datasets if d in per]
        if expected and None not in expected:
            macro += f" [{sum(expected) / len(expected):.2f}]"
        values = [cell_text(per[d], usual) if d in per else "–" for d in datasets]
        lines.append(f"| {temperature:g} | {budget or '–'} | {algorithm} | " + " | ".join(values) + f" | {macro} |")
    return "\n".join(lines)


def ordering(cells: dict, datasets: list[str], temperature: float, budget: int) -> list[str]:
    """τ(DFLASH_TFM) > τ(DDTREE) > τ(DFLASH) > 1 per dataset, where all three were measured."""
    out = []
    for d in datasets:
        try:
            chain = cells[(temperature, None, "DFLASH")][d]["tau"]
            tree = cells[(temperature, budget, "DDTREE")][d]["tau"]
            tfm = cells[(temperature, budget, "DFLASH_TFM")][d]["tau"]
        except KeyError:
            out.append(f"{d}: not all three measured")
            continue
        holds = tfm > tree > chain > 1
        out.append(f"{d}: TFM {tfm:.2f} > DDTREE {tree:.2f} > DFLASH {chain:.2f} > 1: {'yes' if holds else 'NO'}; "
                   f"TFM / DFLASH = {tfm / chain:.2f}")
    return out


def plot(cells: dict, datasets: list[str], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in sorted(cells, key=lambda k: (k[0], order(k[2]), k[2], k[1] or 0)) if k[2] != "AR"]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(datasets) * len(keys) / 3), 4))
    width = 0.8 / max(1, len(keys))
    for i, key in enumerate(keys):
        per = cells[key]
        xs = [j + i * width for j, d in enumerate(datasets) if d in per]
        ys = [per[d]["tau"] for d in datasets if d in per]
        name = f"{key[2]}" + (f" b{key[1]}" if key[1] else "") + f" T={key[0]:g}"
        ax.bar(xs, ys, width, label=name, hatch="//" if key[0] > 0 else None)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(datasets))], datasets)
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_ylabel("τ (tokens per target forward)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--plot", type=Path, default=None)
    p.add_argument("--budget", type=int, default=64, help="budget of the ordering check")
    args = p.parse_args()
    cells = read_cells(args.files)
    datasets = sorted({d for per in cells.values() for d in per})
    print(table(cells, datasets))
    for temperature in sorted({k[0] for k in cells}):
        print(f"\nordering at T = {temperature:g}, budget {args.budget}:")
        print("\n".join("- " + line for line in ordering(cells, datasets, temperature, args.budget)))
    if args.plot:
        plot(cells, datasets, args.plot)
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
