"""`dflash-tfm demo`: the README's main job. How much faster does one sequence decode with each algorithm?

Loads the embedded SmolLM2-135M-Instruct target (or ``--target-path``) once and a bundle directory holding a
trained DFlash drafter (``dflash/``) and Weaver (``weaver.pth``); then decodes a few held-out prompts per dataset
(MT-Bench, HumanEval, GSM8K test, MATH500, from ``dflash_tfm.bench.datasets``) with AR, DFLASH, DDTREE and
DFLASH_TFM, and prints τ (tokens per target forward), tokens/s and the speedup over AR per dataset and algorithm,
plus the macro average over datasets.

Why it is measured this way: one target is loaded and only the decoder is swapped (``build_decoder``), so every
algorithm sees the same weights and caches; on a GPU each algorithm first prefills every timed prompt, takes one
step at every proposal size it may choose, and decodes one untimed request reaching past the longest timed one, so
CUDA-graph capture, kernel compilation and tuning stay out of the numbers (``--repeat-check`` times everything twice
to show it: the two passes should agree within 5 %; a CPU has nothing to warm);
tok/s = Σ tokens / Σ wall-clock per request, prefill included, as the benchmark harness counts it (BENCHMARK.md);
sampled runs use seed + prompt index for every algorithm. On a CPU a tree verify costs more than a decode step
(in bf16 on a CPU that multiplies it natively a little more, in fp32 about twice as much at 17 nodes), so there
speculation pays only with a high τ; the GPU (memory-bound) is where it shines.

The tree budget is "auto" by default: each step takes the proposal size (0 = a plain decode step) that maximises
expected tokens per second from step times measured on this machine (at start, then step by step), and the table
shows the sizes taken and where a step's time goes (draft / tree / verify / commit). What the budget learns is
dropped before each cell's timed pass, so both passes of ``--repeat-check`` start from the same state.

Without a bundle the demo says so and runs AR only; ``--random-bundle`` writes random drafter and Weaver
checkpoints in the published formats to show the machinery, and labels the table "untrained".
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from rich.console import Console
from rich.table import Table
from tqdm.auto import tqdm

from dflash_tfm.config import ModelConfig
from dflash_tfm.loading.default_model import DEFAULT_BUNDLE
from dflash_tfm.speculative_config import AUTO, tree_budget_arg

if TYPE_CHECKING:
    from dflash_tfm import Engine

DEMO_DATASETS = ("mtbench", "humaneval", "gsm8k", "math500")
ALGORITHMS = ("AR", "DFLASH", "DDTREE", "DFLASH_TFM")
UNTRAINED = "untrained: τ not meaningful"
# (prompts per dataset, max new tokens): a CPU run finishes in about a minute, a GPU run gives steadier numbers.
SIZES = {"cpu": (1, 32), "cuda": (10, 256)}
BLOCK_MARGIN = 16  # room for one draft block past the last generated token


@dataclass(frozen=True)
class Bundle:
    """Checkpoints the speculative algorithms need; a missing part disables the algorithms that need it."""

    dflash: Path | None
    weaver: Path | None
    label: str

    def algorithms(self) -> list[str]:
        algorithms = ["AR"]
        if self.dflash is not None:
            algorithms += ["DFLASH", "DDTREE"] + (["DFLASH_TFM"] if self.weaver is not None else [])
        return algorithms


def find_bundle(path: Path) -> tuple[Bundle, list[str]]:
    """The bundle at ``path`` (``dflash/`` + ``weaver.pth``) and one-line notes on whatever is missing."""
    dflash = path / "dflash" if (path / "dflash" / "config.json").is_file() else None
    weaver = path / "weaver.pth" if (path / "weaver.pth").is_file() else None
    if dflash is None:
        return Bundle(None, None, "AR only (no bundle)"), [
            f"no trained bundle at {path} (expected dflash/ and weaver.pth): running AR only. Train one with "
            "`dflash-tfm train-dflash` and `dflash-tfm train-weaver`, or pass --random-bundle to see the machinery "
            "with random weights."]
    notes = [] if weaver else [f"{path / 'weaver.pth'} is missing: DFLASH_TFM skipped"]
    return Bundle(dflash, weaver, f"bundle {path}"), notes


def write_random_bundle(root: Path, cfg: ModelConfig) -> Bundle:
    """Random drafter (1 layer, block 16) and Weaver (variant 1) for ``cfg`` in the published formats."""
    from dflash_tfm.spec.fixtures import write_random_dflash_checkpoint
    from dflash_tfm.spec.weaver_fixtures import write_random_weaver_checkpoint

    write_random_dflash_checkpoint(root / "dflash", cfg, num_layers=1, block_size=16)
    write_random_weaver_checkpoint(root / "weaver.pth", cfg, variant=1)
    return Bundle(root / "dflash", root / "weaver.pth", UNTRAINED)


def load_demo_prompts(
    names: list[str], per_dataset: int, dataset_dir: Path | None,
) -> tuple[dict[str, list[str]], list[str]]:
    """``per_dataset`` seeded held-out prompts per dataset (the harness's subsample); a dataset that is not
    available offline becomes a one-line note instead of an error."""
    from dflash_tfm.bench.datasets import DatasetUnavailable, prepare_dataset

    prompts, notes = {}, []
    for name in names:
        try:
            prompts[name] = [p.text for p in prepare_dataset(name, limit=per_dataset, dataset_dir=dataset_dir).prompts]
        except DatasetUnavailable as e:
            notes.append(f"skip {name}: {e}")
    return prompts, notes


def fit_prompts(
    engine: Engine, prompts: dict[str, list[str]], max_new_tokens: int,
) -> tuple[dict[str, list[str]], list[str]]:
    """Drop prompts whose request would run into the end of the static caches (there the speculative decoders
    fall back to plain decode steps, which would skew τ), with a note per dataset."""
    limit = engine.max_model_len - max_new_tokens - BLOCK_MARGIN
    fitted, notes = {}, []
    for name, texts in prompts.items():
        kept = [t for t in texts if len(engine.encode_prompt(t, chat=True)) <= limit]
        if len(kept) < len(texts):
            notes.append(f"{name}: skipped {len(texts) - len(kept)} prompt(s) longer than {limit} tokens "
                         "(raise --max-model-len)")
        if kept:
            fitted[name] = kept
    return fitted, notes


PHASES = ("draft", "tree", "verify", "commit")


@dataclass
class Cell:
    """One (dataset, algorithm) entry: totals over its prompts, the per-request τ, the decode steps' phase time
    and the proposal sizes they took."""

    dataset: str
    algorithm: str
    tokens: int = 0
    seconds: float = 0.0
    taus: list[float] = field(default_factory=list)
    steps: int = 0
    phase_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    sizes: dict[int, int] = field(default_factory=dict)  # decode steps per proposal size
    repeat_seconds: float | None = None  # the same requests timed again (--repeat-check)
    expected_taus: list[float] = field(default_factory=list)  # per request, when the decoder tracks them

    def add(self, stats, seconds: float) -> None:
        self.seconds += seconds
        self.tokens += stats.completion_tokens
        self.taus.append(stats.accept_length)
        if stats.expected_accept_length is not None:
            self.expected_taus.append(stats.expected_accept_length)
        self.steps += stats.verify_steps - 1  # the prefill made the first token
        for phase in PHASES:
            self.phase_seconds[phase] += getattr(stats, f"{phase}_seconds")
        self.count_sizes(stats.draft_sizes)

    def count_sizes(self, sizes: dict[int, int]) -> None:
        for size, steps in sizes.items():
            self.sizes[size] = self.sizes.get(size, 0) + steps

    def phase_ms(self, phase: str) -> float:
        return 1e3 * self.phase_seconds[phase] / self.steps if self.steps else 0.0

    def sizes_text(self) -> str:
        """The proposal sizes taken, most frequent first, with their share of the decode steps."""
        total = sum(self.sizes.values())
        common = sorted(self.sizes.items(), key=lambda item: -item[1])[:3]
        return " ".join(f"{size}:{100 * n / total:.0f}%" for size, n in common) if total else "-"

    @property
    def tau(self) -> float:
        return sum(self.taus) / len(self.taus) if self.taus else 0.0

    @property
    def expected_tau(self) -> float | None:
        """τ with accepted drafts replaced by their exact expectation (`GenerationStats.expected_accept_length`)."""
        return sum(self.expected_taus) / len(self.expected_taus) if self.expected_taus else None

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def warm_up(engine: Engine, texts: list[str], max_new_tokens: int, temperature: float, seed: int) -> None:
    """GPU only: prefill every timed prompt (each prompt length is its own prefill shape, tuned and compiled at
    first sight), take one step at every proposal size the decoder may choose with these sampling settings, then
    decode from the shortest prompt to beyond where the longest request will end, so every key-length bucket's
    CUDA graph is captured before anything is timed."""
    from dflash_tfm import SamplingParams
    from dflash_tfm.sampling import make_generator

    ids = [engine.encode_prompt(t, chat=True) for t in texts]
    for prompt in ids:
        engine.generate(prompt, SamplingParams(temperature=temperature, max_new_tokens=1, seed=seed))
    shortest = min(range(len(texts)), key=lambda i: len(ids[i]))
    params = SamplingParams(temperature=temperature, seed=seed, ignore_eos=True)
    if getattr(engine.decoder, "budget", None) is not None:
        engine.decoder.warm_up_sizes(ids[shortest], params, make_generator(params, engine.device))
    params.max_new_tokens = max(1, min(max(map(len, ids)) + max_new_tokens, engine.max_model_len - 1) - len(ids[shortest]))
    engine.generate(ids[shortest], params)


def run_algorithms(
    engine: Engine, bundle: Bundle, prompts: dict[str, list[str]], *, max_new_tokens: int, temperature: float,
    budget: int | str, seed: int, algorithms: list[str] | None = None, on_cell: Callable[[Cell], None] | None = None,
    progress: bool = True, children_per_node: int | None = None, repeat: bool = False, track_expected: bool = False,
) -> list[Cell]:
    """Decode every prompt with every algorithm the bundle allows (or those of ``algorithms`` it allows), one
    decoder at a time on one target; ``on_cell`` sees each finished (dataset, algorithm) cell.
    ``children_per_node``: DFLASH_TFM's tree width (None: the engine default). ``repeat``: time each cell's
    requests a second time into ``Cell.repeat_seconds`` (the same seeds: the same tokens). ``track_expected``:
    the speculative decoders also sum each tree's exact expected acceptance (``Cell.expected_taus``)."""
    from dflash_tfm import SamplingParams, SpeculativeConfig
    from dflash_tfm.engine.decoder_factory import build_decoder

    algorithms = [a for a in bundle.algorithms() if algorithms is None or a in algorithms]
    every_text = [t for texts in prompts.values() for t in texts]
    cells: list[Cell] = []
    total = len(algorithms) * sum(len(t) for t in prompts.values()) * (2 if repeat else 1)
    with tqdm(total=total, desc="demo", unit="request", disable=not progress) as bar:
        for algo in algorithms:
            spec = SpeculativeConfig() if algo == "AR" else SpeculativeConfig(
                algo, bundle.dflash, bundle.weaver if algo == "DFLASH_TFM" else None, budget,
                **({} if children_per_node is None else {"children_per_node": children_per_node}))
            engine.decoder = build_decoder(engine.runner, engine.config, spec)
            if track_expected and algo != "AR":
                engine.decoder.track_expected = True
            if every_text and engine.device.type == "cuda":
                warm_up(engine, every_text, max_new_tokens, temperature, seed)
            for dataset, texts in prompts.items():
                cell = Cell(dataset, algo)
                for timed_pass in range(2 if repeat else 1):
                    if getattr(engine.decoder, "budget", None) is not None:
                        engine.decoder.budget.forget()  # each pass learns from the same start: same choices
                    seconds = 0.0
                    for i, text in enumerate(texts):
                        params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed + i)
                        start = time.perf_counter()
                        out = engine.generate(text, params, chat=True)
                        elapsed = time.perf_counter() - start
                        seconds += elapsed
                        if timed_pass == 0:
                            cell.add(out.stats, elapsed)
                        bar.set_postfix_str(f"{algo} {dataset}")
                        bar.update()
                    if timed_pass == 1:
                        cell.repeat_seconds = seconds
                cells.append(cell)
                if on_cell is not None:
                    on_cell(cell)
    return cells


def summarize(cells: list[Cell]) -> list[dict]:
    """Table rows: per dataset and algorithm, then "Macro Avg" per algorithm (unweighted means over datasets;
    its speedup = mean tok/s ÷ mean AR tok/s, as the harness divides by the mean baseline)."""
    ar = {c.dataset: c.tok_s for c in cells if c.algorithm == "AR"}
    datasets = list(dict.fromkeys(c.dataset for c in cells))
    rows = [{"dataset": c.dataset, "algorithm": c.algorithm, "prompts": len(c.taus), "tokens": c.tokens,
             "tau": c.tau, "tok_s": c.tok_s, "speedup": c.tok_s / ar[c.dataset] if ar.get(c.dataset) else None,
             **_step_columns([c])}
            for d in datasets for c in cells if c.dataset == d]
    ar_mean = sum(ar.values()) / len(ar) if ar else 0.0
    for algo in dict.fromkeys(c.algorithm for c in cells):
        mine = [c for c in cells if c.algorithm == algo]
        tok_s = sum(c.tok_s for c in mine) / len(mine)
        rows.append({"dataset": "Macro Avg", "algorithm": algo, "prompts": sum(len(c.taus) for c in mine),
                     "tokens": sum(c.tokens for c in mine), "tau": sum(c.tau for c in mine) / len(mine),
                     "tok_s": tok_s, "speedup": tok_s / ar_mean if ar_mean else None, **_step_columns(mine)})
    return rows


def _step_columns(cells: list[Cell]) -> dict:
    """ms per decode step of each phase (speculative algorithms only) and the proposal sizes taken."""
    merged = Cell("", "")
    for c in cells:
        merged.steps += c.steps
        merged.count_sizes(c.sizes)
        for phase in PHASES:
            merged.phase_seconds[phase] += c.phase_seconds[phase]
    timed = any(merged.phase_seconds.values())
    return {**{f"{phase}_ms": merged.phase_ms(phase) if timed else None for phase in PHASES},
            "sizes": merged.sizes_text() if timed else "-"}


def pass_deviation(cells: list[Cell]) -> tuple[float, str]:
    """The largest relative difference between a cell's first and repeated timed pass, and its cell."""
    worst, where = 0.0, "-"
    for c in cells:
        if c.repeat_seconds is not None and c.seconds > 0:
            gap = abs(c.repeat_seconds - c.seconds) / c.seconds
            if gap >= worst:
                worst, where = gap, f"{c.dataset} {c.algorithm}"
    return worst, where


def render(rows: list[dict], title: str, console: Console) -> None:
    """One rich table, a section per dataset, Macro Avg last (rich prints plain box text when not a terminal)."""
    table = Table(title=title)
    for name, justify in (("dataset", "left"), ("algorithm", "left"), ("prompts", "right"), ("tokens", "right"),
                          ("τ", "right"), ("tok/s", "right"), ("speedup", "right"),
                          ("ms/step: draft tree verify commit", "right"), ("sizes taken", "left")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    previous = None
    for r in rows:
        if previous is not None and r["dataset"] != previous:
            table.add_section()
        previous = r["dataset"]
        speedup = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        phases = "-" if r["verify_ms"] is None else " ".join(f"{r[f'{p}_ms']:.2f}" for p in PHASES)
        table.add_row(r["dataset"], r["algorithm"], str(r["prompts"]), str(r["tokens"]), f"{r['tau']:.2f}",
                      f"{r['tok_s']:.1f}", speedup, phases, r["sizes"])
    console.print(table)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-tfm demo", description=__doc__.splitlines()[0])
    p.add_argument("--target-path", "--model-path", dest="target_path", default=None,
                   help="target HF dir or .gguf (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--bundle", type=Path, default=DEFAULT_BUNDLE, help="directory with dflash/ and weaver.pth")
    p.add_argument("--random-bundle", action="store_true",
                   help="use random drafter/Weaver checkpoints (shows the machinery; τ is not meaningful)")
    p.add_argument("--datasets", nargs="+", default=list(DEMO_DATASETS), help="from " + " ".join(DEMO_DATASETS))
    p.add_argument("--prompts-per-dataset", type=int, default=None,
                   help="default: 1 on CPU, 10 on GPU")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="default: 32 on CPU, 256 on GPU")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--budget", type=tree_budget_arg, default=AUTO,
                   help="proposal size (nodes below the root) for DDTREE / DFLASH_TFM, or 'auto' (the default): each "
                        "step takes the size that pays best on this machine, 0 (a plain decode step) included; 'auto' "
                        "also adapts DFLASH's chain length")
    p.add_argument("--repeat-check", action="store_true",
                   help="time every cell twice and report how far the passes differ (warm-up is complete when they "
                        "agree within 5 %%)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed of prompt i is seed + i")
    p.add_argument("--device", default=None, help="cuda, cpu (default: cuda if available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--threads", type=int, default=None,
                   help="CPU intra-op threads (default: torch's); 1 is often faster on shared, oversubscribed CPUs")
    p.add_argument("--max-model-len", type=int, default=1024,
                   help="static cache length (memory for the caches)")
    p.add_argument("--dataset-dir", type=Path, default=None, help="extra directory of <dataset>.jsonl prompt files")
    p.add_argument("--json", type=Path, default=None, help="also write the table rows and settings as JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    """``dflash-tfm demo``. Input and checkpoint errors print one line and return 2."""
    from dflash_tfm import Engine
    from dflash_tfm.errors import CheckpointError

    args = build_parser().parse_args(argv)
    console = Console() if sys.stdout.isatty() else Console(width=160)  # a pipe or log: wide enough for the table
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        per_dataset, max_new = SIZES.get(device.type, SIZES["cpu"])
        per_dataset = args.prompts_per_dataset or per_dataset
        max_new = args.max_new_tokens or max_new
        prompts, notes = load_demo_prompts(args.datasets, per_dataset, args.dataset_dir)
        if not prompts:
            raise ValueError("no dataset is available offline: " + "; ".join(notes))
        engine = Engine(args.target_path, device=device, dtype=args.dtype, max_model_len=args.max_model_len)
        prompts, fit_notes = fit_prompts(engine, prompts, max_new)
        notes += fit_notes
        if not prompts:
            raise ValueError("every prompt is too long for --max-model-len: " + "; ".join(fit_notes))
        with tempfile.TemporaryDirectory(prefix="dflash_tfm_demo_") as tmp:
            if args.random_bundle:
                bundle = write_random_bundle(Path(tmp), engine.config)
            else:
                bundle, bundle_notes = find_bundle(args.bundle)
                notes += bundle_notes
            for note in [engine.kernel_path, *notes]:
                console.print(note, markup=False, highlight=False)
            cells = run_algorithms(engine, bundle, prompts, max_new_tokens=max_new, temperature=args.temperature,
                                   budget=args.budget, seed=args.seed, repeat=args.repeat_check)
    except (FileNotFoundError, CheckpointError, ValueError) as e:
        print(f"dflash-tfm demo: error: {e}", file=sys.stderr)
        return 2
    rows = summarize(cells)
    title = (f"{engine.model_path.name} on {device.type} ({engine.dtype}), {bundle.label}; "
             f"{max_new} new tokens, temperature {args.temperature}, budget {args.budget}")
    render(rows, title, console)
    if args.repeat_check:
        worst, where = pass_deviation(cells)
        verdict = "within 5 %" if worst <= 0.05 else "MORE than 5 %: warm-up missed something"
        console.print(f"first vs repeated timed pass: largest difference {100 * worst:.1f} % ({where}), {verdict}",
                      markup=False, highlight=False)
    if args.json:
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        settings.update(device=str(device), prompts_per_dataset=per_dataset, max_new_tokens=max_new, label=bundle.label)
        args.json.write_text(json.dumps({"settings": settings, "rows": rows,
                                         "cells": [asdict(c) for c in cells]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
