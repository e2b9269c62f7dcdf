"""How much FP8 block quantization changes a target's greedy outputs: GSM8K prompts decoded greedily by the
target as loaded and by the same target with `--quantization fp8` (its projections quantized in 128 × 128 blocks
at load, as Qwen's FP8 releases are), side by side.

Reported per prompt and in total: the share of generated tokens equal at the same position, where the two first
differ, and whether the final answers (the last number of each output) agree. Greedy decoding amplifies any
change (after the first different token the continuations drift apart), so the answer agreement is the number
that says what a user would notice. A script, not a test:

    python -m benchmarks.fp8_agreement [--target-path P] [--prompts 20] [--max-new-tokens 256] [--out F.json]
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch
from tqdm import tqdm

from dflash_tfm.bench.datasets import prepare_dataset

NUMBER = re.compile(r"-?\d[\d,]*\.?\d*")


def final_answer(text: str) -> str | None:
    """The last number of an output, commas dropped (GSM8K answers are numbers)."""
    found = NUMBER.findall(text)
    return found[-1].replace(",", "").rstrip(".") if found else None


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (the shorter one's end counts), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(texts: list[str], engines: dict, max_new_tokens: int) -> list[dict]:
    from dflash_tfm import SamplingParams

    rows = []
    for text in tqdm(texts, desc="prompts", unit="prompt"):
        outs = {name: e.generate(text, SamplingParams(max_new_tokens=max_new_tokens), chat=True)
                for name, e in engines.items()}
        a, b = outs.values()
        answers = [final_answer(a.text), final_answer(b.text)]
        rows.append({"prompt": text[:80], "tokens": len(a.token_ids),
                     "same_position": sum(x == y for x, y in zip(a.token_ids, b.token_ids)),
                     "first_difference": first_difference(a.token_ids, b.token_ids),
                     "answers": answers, "answers_agree": answers[0] == answers[1]})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target-path", default=None, help="target checkpoint (default: embedded SmolLM2)")
    p.add_argument("--prompts", type=int, default=20, help="GSM8K test prompts (the harness's seeded subsample)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default=None)
    p.add_argument("--dataset-dir", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    from dflash_tfm import Engine

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    texts = [q.text for q in prepare_dataset("gsm8k", limit=args.prompts, dataset_dir=args.dataset_dir).prompts]
    engines = {name: Engine(args.target_path, device=device, dtype=args.dtype, quantization=q, max_model_len=1024)
               for name, q in ((args.dtype, None), ("fp8", "fp8"))}
    rows = compare(texts, engines, args.max_new_tokens)
    tokens = sum(r["tokens"] for r in rows)
    same = sum(r["same_position"] for r in rows)
    identical = sum(r["first_difference"] is None for r in rows)
    agree = sum(r["answers_agree"] for r in rows)
    summary = {"target": str(engines[args.dtype].model_path.name), "device": str(torch.device(device)),
               "dtype": args.dtype, "prompts": len(rows), "max_new_tokens": args.max_new_tokens,
               "tokens_same_position": same / tokens if tokens else 0.0, "identical_outputs": identical,
               "answers_agree": agree}
    print(f"{summary['target']} {args.dtype} vs FP8 on {device}, {len(rows)} GSM8K prompts, {args.max_new_tokens} "
          f"tokens: identical outputs {identical}/{len(rows)}, tokens equal at their position "
          f"{100 * summary['tokens_same_position']:.1f} %, final answers agree {agree}/{len(rows)}")
    if args.out:
        args.out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
