"""Compare tree builders by the exact expected accept length of their trees on the same decoding states.

τ measured by sampling at T = 1 is noisy (±0.05 per dataset over 20 prompts × 256 tokens, the size of the
differences between good tree builders). Here one decoder runs the request (its first variant builds the tree
that is committed); at every step each variant also builds its tree over the same draft, the target verifies
it, and ``spec.accept.expected_accepted`` gives the exact expected number of drafts acceptance would take
from it (Σ over nodes of the target's path probability). Expected τ of a step = 1 + that. Prompts: a seeded
subsample disjoint from the τ table's (``--seed`` ≠ 0, the table's prompts removed), so choosing a tree
setting here does not tune on the reported prompts. A script, not a test.

    python -m benchmarks.tree_expectation --bundle src/dflash_tfm/assets/smollm2_bundle --temperature 1 \
        --variants DFLASH_TFM:64:8 DDTREE:64 DFLASH_TFM:64:16 --datasets gsm8k mtbench --prompts-per-dataset 4
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from tqdm import tqdm

from dflash_tfm.bench.datasets import SUBSAMPLE_SEED, prepare_dataset
from dflash_tfm.engine.decoder_factory import build_proposer
from dflash_tfm.engine.speculative import Proposer, SpeculativeDecoder
from dflash_tfm.sampling import make_generator
from dflash_tfm.sampling_params import SamplingParams
from dflash_tfm.spec.accept import expected_accepted
from dflash_tfm.speculative_config import DEFAULT_CHILDREN_PER_NODE, SpeculativeConfig


@torch.inference_mode()
def step_scoring(decoder: SpeculativeDecoder, params: SamplingParams, generator: torch.Generator | None,
                 proposers: list[Proposer]) -> tuple[list[int], list[float]]:
    """``decoder.step`` (eager, no graphs, through the decoder's phases), also scoring other tree builders on the
    same draft: each of ``proposers`` builds and verifies its tree (caches untouched until the commit), and every
    tree gets the exact expected number of drafts acceptance would take from it (``expected_accepted``). Returns
    the step's tokens and the expectations, the decoder's own tree first, then those of ``proposers``."""
    if decoder.length + decoder.max_depth + 1 > decoder.runner.max_len:
        raise ValueError("step_scoring needs a block of room before the end of the cache")
    if not params.greedy:
        decoder._uniforms.uniform_(generator=generator)
    decoder._draft(decoder.runner.bucket(decoder.length + decoder.max_depth))
    size = max(decoder.proposers)  # a fixed-budget decoder: its one size
    own, expectations = decoder.proposers[size], []
    try:
        for proposer in [*proposers, own]:  # own last: its verified tree is the one committed
            decoder.proposers[size] = proposer
            decoder._tree(size)
            decoder._verify(size)
            tokens, parents, _, tree = decoder._trees[size]
            expectations.append(float(expected_accepted(
                decoder._verified[size][3], tokens, parents, tree.ancestor_mask()[0], params)))
    finally:
        decoder.proposers[size] = own
    decoder._commit(params, size)
    return decoder._take_emitted(), expectations[-1:] + expectations[:-1]


def parse_variant(text: str) -> tuple[str, int, int]:
    """"ALGO:BUDGET[:CHILDREN]" -> (algorithm, budget, children per node; the engine's default if omitted)."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or parts[0] not in ("DFLASH", "DDTREE", "DFLASH_TFM"):
        raise argparse.ArgumentTypeError(f"variant must be ALGO:BUDGET[:CHILDREN], got {text!r}")
    return parts[0], int(parts[1]), int(parts[2]) if len(parts) == 3 else DEFAULT_CHILDREN_PER_NODE


def held_out_prompts(name: str, count: int, seed: int, dataset_dir: Path | None) -> list[str]:
    """``count`` prompts of the seed-``seed`` subsample that are not in the τ table's (seed 0) 20."""
    reported = {p.text for p in prepare_dataset(name, limit=20, seed=SUBSAMPLE_SEED, dataset_dir=dataset_dir).prompts}
    pool = prepare_dataset(name, limit=count + 20, seed=seed, dataset_dir=dataset_dir).prompts
    return [p.text for p in pool if p.text not in reported][:count]


def variant_config(bundle: Path, algo: str, budget: int, children: int) -> SpeculativeConfig:
    return SpeculativeConfig(algo, bundle / "dflash", bundle / "weaver.pth" if algo == "DFLASH_TFM" else None, budget,
                             children)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target-path", default=None, help="target checkpoint (default: embedded SmolLM2)")
    p.add_argument("--bundle", type=Path, required=True, help="directory with dflash/ and weaver.pth")
    p.add_argument("--variants", type=parse_variant, nargs="+", required=True,
                   help="ALGO:BUDGET[:CHILDREN]; the first one's trees are committed")
    p.add_argument("--datasets", nargs="+", default=["mtbench", "humaneval", "gsm8k", "math500"])
    p.add_argument("--dataset-dir", type=Path, default=None)
    p.add_argument("--prompts-per-dataset", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1, help="subsample seed (not 0: the τ table's prompts)")
    p.add_argument("--device", default=None)
    p.add_argument("--out", type=Path, default=None, help="JSON lines, appended (one per dataset)")
    args = p.parse_args()

    from dflash_tfm import Engine

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    algo, budget, children = args.variants[0]
    engine = Engine(args.target_path, variant_config(args.bundle, algo, budget, children), device=device,
                    max_model_len=1024, use_cuda_graph=False)
    block = engine.decoder.block
    others = [build_proposer(variant_config(args.bundle, a, b, c), engine.runner, engine.config, block)
              for a, b, c in args.variants[1:]]  # the first variant is the engine's own decoder
    names = [f"{a}:{b}:{c}" if a == "DFLASH_TFM" else f"{a}:{b}" for a, b, c in args.variants]
    params = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    for dataset in args.datasets:
        per_prompt = [[] for _ in names]  # mean expected τ per step, per prompt
        for i, text in enumerate(tqdm(held_out_prompts(dataset, args.prompts_per_dataset, args.seed, args.dataset_dir),
                                      desc=dataset)):
            params.seed = 1000 * args.seed + i
            generator = make_generator(params, device)
            ids = engine.encode_prompt(text, chat=True)
            first = engine.decoder.prefill(ids, params, generator)
            produced, steps = 1, [[] for _ in names]
            stop = first in engine.eos_token_ids
            while not stop and produced < args.max_new_tokens:
                out, expectations = step_scoring(engine.decoder, params, generator, others)
                for s, e in zip(steps, expectations):
                    s.append(1.0 + e)
                produced += len(out)
                stop = any(t in engine.eos_token_ids for t in out)
            for acc, s in zip(per_prompt, steps):
                if s:
                    acc.append(statistics.fmean(s))
        row = {"dataset": dataset, "temperature": args.temperature, "prompts": len(per_prompt[0]),
               "max_new_tokens": args.max_new_tokens, "expected_tau": {n: v for n, v in zip(names, per_prompt)}}
        print(f"{dataset} (T = {args.temperature}, {len(per_prompt[0])} prompts): expected τ per step")
        for n, v in zip(names, per_prompt):
            diff = [a - b for a, b in zip(v, per_prompt[0])]
            se = statistics.stdev(diff) / len(diff) ** 0.5 if len(diff) > 1 else float("nan")
            print(f"  {n:18s} {statistics.fmean(v):.3f}   vs {names[0]}: {statistics.fmean(diff):+.3f} ± {se:.3f}")
        if args.out:
            with args.out.open("a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
