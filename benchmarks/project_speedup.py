"""Projected tokens per second at Qwen3.6-27B scale: measured step times × measured (or given) τ. On paper.

No run measures both halves of the speed at 27B: `bench_spec_step` times each algorithm's step at 27B shapes with
random weights (so nothing is accepted), and τ, the tokens one target verify step yields, comes from trained models
(`measure_acceptance` on the SmolLM2 bundle) or from the user (`--tau`, e.g. a published τ). This multiplies them
per algorithm and tree budget: projected tok/s = 1000 · τ / step ms, and AR = 1000 / AR step ms (τ = 1), the
speedup taken against the AR step of the same step-time run. The table is labelled a projection and names the GPU
and every input; a mode with a step time but no τ (or a τ but no step time) gets a note, never a number.

    python -m benchmarks.project_speedup --gpu H100 \
        --step-times docs/data/perf/spec_step_h100_2026-12-05_renovated.json \
        --acceptance docs/data/tau/*.jsonl [--temperature 0] [--tau DFLASH=6.5 DFLASH_TFM:64=8.0] [--out proj.json]

τ files: the cells at --temperature, averaged over datasets per (algorithm, budget) as `acceptance_report` does
(macro). --tau ALGO[:BUDGET]=VALUE overrides them; without a budget it applies to every budget of ALGO; ALGO is a
label of the τ table (DFLASH, DDTREE, DFLASH_TFM, or "DFLASH_TFM c8" for a non-default Weaver width). Several
step-time files may be given (e.g. budgets split over runs): a mode in more than one comes from the last.
Unusable inputs (a missing or malformed file, a malformed --tau, no mode with both numbers) exit 2 with one line.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.acceptance_report import TFM_CHILDREN, label, order, read_cells

Mode = tuple[str, int | None]  # (τ-table label, tree budget; None for DFLASH)

MODE_NAME = re.compile(r"(DFLASH|DDTREE|DFLASH_TFM)(?: (\d+))?(?: c(\d+))?")  # as bench_spec_step names modes
USER_TAU = re.compile(r"(DFLASH|DDTREE|DFLASH_TFM)(?: c(\d+))?(?::(\d+))?=(.+)")  # ALGO[ cN][:BUDGET]=τ


class BadInput(ValueError):
    """An input the projection cannot use; the CLI exits 2 with its message."""


@dataclass(frozen=True)
class Tau:
    value: float
    source: str  # "file" or "user"
    datasets: tuple[str, ...] = ()  # the datasets a file τ averages


@dataclass(frozen=True)
class StepTime:
    step_ms: float
    run: int  # index into the step-time files


@dataclass
class Row:
    algorithm: str
    budget: int | None
    tau: float
    tau_source: str
    step_ms: float
    tok_s: float
    speedup: float
    run: int
    best: bool = False


def mode_label(algorithm: str, children: int | None) -> str:
    """The τ table's name of an algorithm: DFLASH_TFM with a non-default width carries it ("DFLASH_TFM c8");
    children None = the default width."""
    return label({"algorithm": algorithm, "children_per_node": children or TFM_CHILDREN})


def mode_name(mode: Mode) -> str:
    algorithm, budget = mode
    return algorithm if budget is None else f"{algorithm} {budget}"


def parse_step_mode(name: str, path: Path) -> Mode:
    """"DFLASH" / "DDTREE 64" / "DFLASH_TFM 64 c16" -> the τ table's (label, budget)."""
    match = MODE_NAME.fullmatch(name)
    if (not match or (match[2] is None) != (match[1] == "DFLASH")
            or (match[3] is None) != (match[1] != "DFLASH_TFM")):
        raise BadInput(f"{path}: mode {name!r} is not one bench_spec_step writes")
    algorithm, budget, children = match.groups()
    return mode_label(algorithm, int(children) if children else None), int(budget) if budget else None


def read_step_times(paths: list[Path]) -> tuple[list[float], dict[Mode, StepTime], list[str]]:
    """AR step ms per file, the step time of every mode (a later file's wins) and notes on replaced modes."""
    ar_ms: list[float] = []
    modes: dict[Mode, StepTime] = {}
    notes: list[str] = []
    for run, path in enumerate(paths):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            ar_ms.append(float(data["ar_step_ms"]))
            timed = {name: float(r["step_ms"]) for name, r in data["modes"].items()}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise BadInput(f"{path}: not a bench_spec_step JSON file ({e!r})") from e
        for name, step_ms in timed.items():
            mode = parse_step_mode(name, path)
            if mode in modes:
                notes.append(f"{mode_name(mode)}: step time from [{run + 1}], not [{modes[mode].run + 1}]")
            modes[mode] = StepTime(step_ms, run)
    return ar_ms, modes, notes


def file_taus(paths: list[Path], temperature: float) -> dict[Mode, Tau]:
    """τ per (label, budget) at `temperature`: the mean over datasets of `measure_acceptance` cells (macro)."""
    cells: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for path in paths:
        try:
            for key, per_dataset in read_cells([path]).items():
                cells[key].update(per_dataset)  # a later file's cell wins, as in acceptance_report
        except (ValueError, KeyError, TypeError) as e:
            raise BadInput(f"{path}: not a measure_acceptance JSON-lines file ({e!r})") from e
    taus = {}
    for (cell_temperature, budget, algorithm), per_dataset in cells.items():
        if cell_temperature == temperature and algorithm != "AR":  # AR's τ is 1 by definition
            values = [row["tau"] for row in per_dataset.values()]
            taus[(algorithm, budget)] = Tau(sum(values) / len(values), "file", tuple(sorted(per_dataset)))
    return taus


def parse_user_taus(texts: list[str]) -> dict[Mode, Tau]:
    """"ALGO[:BUDGET]=VALUE" -> {(label, budget or None): τ}; None on a tree algorithm means every budget."""
    taus = {}
    for text in texts:
        match = USER_TAU.fullmatch(text)
        if not match:
            raise BadInput(f"--tau {text!r}: expected ALGO[:BUDGET]=VALUE with ALGO one of DFLASH, DDTREE, "
                           "DFLASH_TFM, 'DFLASH_TFM cN'")
        algorithm, children, budget, value = match.groups()
        if children and algorithm != "DFLASH_TFM":
            raise BadInput(f"--tau {text!r}: only DFLASH_TFM has a width (cN)")
        if budget and algorithm == "DFLASH":
            raise BadInput(f"--tau {text!r}: DFLASH has no tree budget")
        try:
            tau = float(value)
        except ValueError:
            raise BadInput(f"--tau {text!r}: {value!r} is not a number") from None
        if not (math.isfinite(tau) and tau >= 1):
            raise BadInput(f"--tau {text!r}: τ counts the bonus token, so it is at least 1")
        mode = (mode_label(algorithm, int(children) if children else None), int(budget) if budget else None)
        taus[mode] = Tau(tau, "user")
    return taus


def choose_taus(step_modes: dict[Mode, StepTime], from_files: dict[Mode, Tau],
                from_user: dict[Mode, Tau]) -> tuple[dict[Mode, Tau], list[str]]:
    """The τ of every mode that has one (user values over file values: a budget's own, then the algorithm's), and
    notes on user values that replace a file's or match no timed mode."""
    chosen, notes = dict(from_files), []
    for mode in step_modes:
        user = from_user.get(mode) or from_user.get((mode[0], None))
        if user and mode in from_files:
            notes.append(f"{mode_name(mode)}: user τ {user.value:.2f} over the files' {from_files[mode].value:.2f}")
        if user:
            chosen[mode] = user
    used = {mode if mode in from_user else (mode[0], None) for mode in step_modes}
    notes += [f"--tau {mode_name(mode)}: matches no mode of the step-time files"
              for mode in from_user if mode not in used]
    return chosen, notes


def project(ar_ms: list[float], step_modes: dict[Mode, StepTime], taus: dict[Mode, Tau],
            temperature: float) -> tuple[list[Row], list[str]]:
    """A row per AR run and per mode with both a step time and a τ; notes on modes with only one of them."""
    rows = [Row("AR", None, 1.0, "definition", ms, 1000 / ms, 1.0, run) for run, ms in enumerate(ar_ms)]
    notes = []
    for mode, step in step_modes.items():
        tau = taus.get(mode)
        if tau is None:
            notes.append(f"{mode_name(mode)}: step time [{step.run + 1}] but no τ at T = {temperature:g}: no row")
            continue
        source = tau.source if not tau.datasets else f"file, {len(tau.datasets)} sets"
        rows.append(Row(mode[0], mode[1], tau.value, source, step.step_ms, 1000 * tau.value / step.step_ms,
                        tau.value * ar_ms[step.run] / step.step_ms, step.run))
    untimed = sorted((mode for mode in taus if mode not in step_modes), key=lambda m: (order(m[0]), m[0], m[1] or 0))
    notes += [f"{mode_name(mode)}: τ ({taus[mode].source}) but no step time in the step-time files: no row"
              for mode in untimed]
    mark_best(rows)
    rows.sort(key=lambda r: (order(r.algorithm), r.algorithm, r.budget or 0, r.run))
    return rows, notes


def mark_best(rows: list[Row]) -> None:
    """Per algorithm with several budgets, the one with the highest projected speedup."""
    by_algorithm: dict[str, list[Row]] = defaultdict(list)
    for row in rows:
        if row.algorithm != "AR":
            by_algorithm[row.algorithm].append(row)
    for candidates in by_algorithm.values():
        if len(candidates) > 1:
            max(candidates, key=lambda r: r.speedup).best = True


def header(gpu: str, step_files: list[Path], acceptance_files: list[Path], user_taus: list[str],
           from_files: dict[Mode, Tau], temperature: float) -> list[str]:
    runs = ", ".join(f"[{i + 1}] {path}" for i, path in enumerate(step_files))
    sources = []
    if acceptance_files:
        datasets = sorted({d for tau in from_files.values() for d in tau.datasets})
        sources.append(f"{len(acceptance_files)} measure_acceptance files at T = {temperature:g}, macro average over "
                       f"{', '.join(datasets) or 'no datasets'}")
    if user_taus:
        sources.append("the user: " + " ".join(user_taus))
    return [f"PROJECTION, not a measurement: step times measured on {gpu} at 27B shapes with random weights "
            f"(files {runs}), τ from {' and '.join(sources)}.",
            "projected tok/s = 1000 · τ / step ms; speedup = projected tok/s ÷ AR tok/s (1000 / AR step ms, τ = 1) "
            "of the same step-time run; best = the budget with the highest projected speedup of its algorithm."]


def table(rows: list[Row], several_runs: bool) -> str:
    run_head, run_rule = (" run |", "---|") if several_runs else ("", "")
    lines = [f"| algorithm | budget | τ | τ from | step ms | projected tok/s | projected speedup |{run_head} best |",
             f"|---|---|---|---|---|---|---|{run_rule}---|"]
    for r in rows:
        run = f" [{r.run + 1}] |" if several_runs else ""
        lines.append(f"| {r.algorithm} | {r.budget or '–'} | {r.tau:.2f} | {r.tau_source} | {r.step_ms:.2f} "
                     f"| {r.tok_s:.2f} | {r.speedup:.2f}× |{run} {'best' if r.best else ''} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.project_speedup", description=__doc__.splitlines()[0])
    p.add_argument("--gpu", required=True, help="the GPU the step times were measured on (their files do not say)")
    p.add_argument("--step-times", type=Path, nargs="+", required=True, help="bench_spec_step --out JSON files")
    p.add_argument("--acceptance", type=Path, nargs="+", default=[], help="measure_acceptance JSON-lines files")
    p.add_argument("--tau", nargs="+", default=[], metavar="ALGO[:BUDGET]=VALUE", help="τ values, over the files'")
    p.add_argument("--temperature", type=float, default=0.0, help="the τ cells used from the files")
    p.add_argument("--out", type=Path, default=None, help="JSON with the rows, notes and the inputs' paths")
    return p


def run(args: argparse.Namespace) -> tuple[dict, str]:
    """The projection as --out writes it (a row's `run` indexes `step_time_files`) and as it is printed."""
    if not args.acceptance and not args.tau:
        raise BadInput("no τ: give --acceptance files, --tau values or both")
    missing = [str(path) for path in [*args.step_times, *args.acceptance] if not path.is_file()]
    if missing:
        raise BadInput(f"no such file: {', '.join(missing)}")
    ar_ms, step_modes, step_notes = read_step_times(args.step_times)
    from_files = file_taus(args.acceptance, args.temperature)
    taus, tau_notes = choose_taus(step_modes, from_files, parse_user_taus(args.tau))
    rows, mode_notes = project(ar_ms, step_modes, taus, args.temperature)
    if len(rows) == len(ar_ms):
        raise BadInput(f"no mode has both a step time and a τ: timed {sorted(map(mode_name, step_modes))}, "
                       f"τ for {sorted(map(mode_name, taus))}")
    notes = step_notes + tau_notes + mode_notes
    lines = header(args.gpu, args.step_times, args.acceptance, args.tau, from_files, args.temperature)
    note_block = ["", *("note: " + n for n in notes)] if notes else []
    result = {"projection": True, "gpu": args.gpu, "temperature": args.temperature,
              "step_time_files": [str(p) for p in args.step_times],
              "acceptance_files": [str(p) for p in args.acceptance], "user_tau": args.tau, "header": lines,
              "rows": [asdict(r) for r in rows], "notes": notes}
    return result, "\n".join([*lines, "", table(rows, len(ar_ms) > 1), *note_block])


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        result, text = run(args)
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from e
    print(text)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
