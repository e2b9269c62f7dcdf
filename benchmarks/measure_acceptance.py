"""Measure the accept length τ of a drafter + Weaver bundle per dataset, algorithm, tree budget and temperature.

The numbers behind the acceptance table in docs/TRAINING.md (a script, not a test). One target and one bundle;
held-out prompts from the harness's datasets (the same seeded subsample as the benchmark); every (temperature,
budget) pair is decoded with the demo's own loop (``dflash_tfm.demo.run_algorithms``), so demo and table measure
the same thing. Budget-independent algorithms (AR, DFLASH) run with the first budget only. A JSON line per
finished (dataset, algorithm) cell is appended to --out at once, with τ and its exact expectation given the
verified trees (``expected_tau``: each step's accepted drafts replaced by the sum over its tree of the target's
path probabilities, free of the sampling noise, so close algorithms compare at T = 1), so a run cut short by a
time limit keeps what it measured; run one process per dataset to use a GPU's idle capacity.

    python -m benchmarks.measure_acceptance --bundle DIR --datasets gsm8k --temperatures 0 1 --budgets 16 32 64 \
        --out tau.jsonl
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dflash_tfm.demo import ALGORITHMS, DEMO_DATASETS, Cell, find_bundle, fit_prompts, load_demo_prompts, run_algorithms
from dflash_tfm.speculative_config import DEFAULT_CHILDREN_PER_NODE

BUDGET_FREE = ("AR", "DFLASH")  # their decoders ignore the tree budget


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target-path", default=None, help="target checkpoint (default: embedded SmolLM2)")
    p.add_argument("--bundle", type=Path, required=True, help="directory with dflash/ and weaver.pth")
    p.add_argument("--datasets", nargs="+", default=list(DEMO_DATASETS))
    p.add_argument("--dataset-dir", type=Path, default=None, help="extra directory of <dataset>.jsonl prompt files")
    p.add_argument("--prompts-per-dataset", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--budgets", type=int, nargs="+", default=[64, 32, 16])
    p.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--children-per-node", type=int, default=DEFAULT_CHILDREN_PER_NODE,
                   help="DFLASH_TFM children per expanded node")
    p.add_argument("--device", default=None)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--out", type=Path, required=True, help="JSON lines, appended")
    args = p.parse_args()

    from dflash_tfm import Engine

    bundle, notes = find_bundle(args.bundle)
    if bundle.dflash is None or bundle.weaver is None:
        raise SystemExit(f"incomplete bundle at {args.bundle}: {'; '.join(notes)}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    prompts, notes = load_demo_prompts(args.datasets, args.prompts_per_dataset, args.dataset_dir)
    engine = Engine(args.target_path, device=device, max_model_len=args.max_model_len)
    prompts, fit_notes = fit_prompts(engine, prompts, args.max_new_tokens)
    for note in notes + fit_notes:
        print(note)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for temperature in args.temperatures:
        for i, budget in enumerate(args.budgets):
            algorithms = [a for a in args.algorithms if i == 0 or a not in BUDGET_FREE]

            def write(cell: Cell, temperature: float = temperature, budget: int = budget) -> None:
                row = {"dataset": cell.dataset, "algorithm": cell.algorithm, "temperature": temperature,
                       "budget": None if cell.algorithm in BUDGET_FREE else budget, "prompts": len(cell.taus),
                       "tokens": cell.tokens, "tau": cell.tau, "tok_s": cell.tok_s, "taus": cell.taus,
                       "expected_tau": cell.expected_tau, "expected_taus": cell.expected_taus,
                       "max_new_tokens": args.max_new_tokens, "device": str(device), "dtype": str(engine.dtype)}
                if cell.algorithm == "DFLASH_TFM":
                    row["children_per_node"] = args.children_per_node
                with args.out.open("a", encoding="utf-8") as f:
                    f.write(json.dumps(row) + "\n")
                expected = "" if cell.expected_tau is None else f" (expected {cell.expected_tau:.2f})"
                print(f"T={temperature} budget={budget} {cell.dataset} {cell.algorithm}: tau {cell.tau:.2f}{expected}, "
                      f"{cell.tok_s:.1f} tok/s", flush=True)

            run_algorithms(engine, bundle, prompts, max_new_tokens=args.max_new_tokens, temperature=temperature,
                           budget=budget, seed=args.seed, algorithms=algorithms, on_cell=write, progress=False,
                           children_per_node=args.children_per_node, track_expected=True)


if __name__ == "__main__":
    main()
