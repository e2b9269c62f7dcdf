"""Compare benchmark runs: bar charts of tok/s/seq and acceptance length from several summary.json files.

`python -m dflash_tfm.bench.plots ar/summary.json dflash/summary.json -o cmp.png`, or the harness's
`--plot-with OTHER_SUMMARY.json ...` (writes OUTPUT_DIR/comparison.png with the current run added).
One bar group per dataset (plus Macro Avg), one bar per run, labelled by the summary's folder name.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: works without a display and on CI
import matplotlib.pyplot as plt  # noqa: E402  (backend must be chosen first)

PANELS = (("tok_s_per_seq", "tok/s/seq", "{:.0f}"), ("accept_length", "accept length (tau)", "{:.2f}"))
MACRO = "Macro Avg"


def _values(summary: dict[str, Any], metric: str) -> dict[str, float]:
    values = {row["dataset"]: float(row[metric]) for row in summary["datasets"]}
    if summary["macro_avg"].get(metric) is not None:
        values[MACRO] = float(summary["macro_avg"][metric])
    return values


def plot_summaries(summary_paths: list[Path], out_png: Path, labels: list[str] | None = None) -> Path:
    """Write a two-panel grouped bar chart of the runs in `summary_paths` to `out_png`; returns its path."""
    summaries = [json.loads(Path(p).read_text(encoding="utf-8")) for p in summary_paths]
    labels = labels or [Path(p).resolve().parent.name or str(p) for p in summary_paths]
    if len(labels) != len(summaries):
        raise ValueError(f"{len(labels)} labels for {len(summaries)} summaries")
    datasets: list[str] = []  # union in first-seen order, Macro Avg last
    for s in summaries:
        datasets += [r["dataset"] for r in s["datasets"] if r["dataset"] not in datasets]
    datasets.append(MACRO)

    width = 0.8 / len(summaries)
    fig, axes = plt.subplots(2, 1, figsize=(max(6.0, 1.0 + 0.5 * len(datasets) * len(summaries)), 7.5))
    for ax, (metric, title, number) in zip(axes, PANELS, strict=True):
        for i, (summary, label) in enumerate(zip(summaries, labels, strict=True)):
            values = _values(summary, metric)
            xs = [j + (i - (len(summaries) - 1) / 2) * width for j in range(len(datasets))]
            heights = [values.get(d, 0.0) for d in datasets]  # a run without that dataset shows no bar
            bars = ax.bar(xs, heights, width, label=label)
            ax.bar_label(bars, labels=[number.format(h) if h else "" for h in heights], fontsize=7, padding=1)
        ax.set_title(title)
        ax.set_xticks(range(len(datasets)), datasets, rotation=20)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return out_png


def main(argv: list[str] | None = None) -> None:
    """CLI: `python -m dflash_tfm.bench.plots A/summary.json B/summary.json -o out.png [--labels A B]`."""
    parser = argparse.ArgumentParser(prog="python -m dflash_tfm.bench.plots", description=__doc__.splitlines()[0])
    parser.add_argument("summaries", nargs="+", type=Path, help="summary.json files written by the harness")
    parser.add_argument("-o", "--output", type=Path, required=True, help="PNG to write")
    parser.add_argument("--labels", nargs="+", default=None, help="one label per summary (default: folder names)")
    args = parser.parse_args(argv)
    try:
        print(f"wrote {plot_summaries(args.summaries, args.output, args.labels)}")
    except ValueError as e:
        parser.error(str(e))


if __name__ == "__main__":
    main()
