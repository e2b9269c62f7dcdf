"""One optimizer step of drafter and Weaver training for the embedded target's shape (SmolLM2-135M, random BF16
weights; GPU script), on real data rows: where a training step's time goes.

Measured with CUDA events after warm-up (median), per step of the bundle's recipe (scripts/train_bundle.sh):
  * drafter: 32 rows x 64 anchors, block 16, 3 layers (--batch-rows, --num-layers); the target features once
    for all rows (`FeatureStore`, wall seconds) or per step (the target pass), the batch assembly on the host,
    and `train_step` with hard and with soft labels;
  * Weaver: 32 positions (4 per row); the frozen teacher's `paths` (drafter blocks, target logits, pools) with
    and without the store, and `train_step`.

    python -m benchmarks.bench_training_step [--data .stage/data/d*.jsonl] --out $OUT/training_step.json [--profile]

(each time is CUDA events around the whole call, so host-side work that keeps the GPU waiting counts too)

--profile also prints the kernels of one drafter step and one Weaver step (teacher + train_step).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.kernel_profile import print_kernel_table
from benchmarks.timing import time_ms, wall_ms
from dflash_tfm.config import ModelConfig
from dflash_tfm.loading.loader import build_model
from dflash_tfm.models.presets import SMOLLM2_135M
from dflash_tfm.models.random_init import init_random_
from dflash_tfm.spec.dflash_config import drafter_config_dict
from dflash_tfm.train import dflash_trainer, weaver_trainer
from dflash_tfm.train.dflash_checkpoint import build_trainable_drafter
from dflash_tfm.train.rows import read_rows
from dflash_tfm.train.target_features import FeatureStore, TargetFeatures
from dflash_tfm.spec.weaver import WeaverConfig
from dflash_tfm.train.weaver_trainer import FrozenTeacher, PositionSampler, new_weaver


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def write_synthetic_rows(path: Path, count: int, vocab: int) -> Path:
    """`count` rows in gen-data's format: 20-200 prompt and 50-256 response tokens, uniform random ids."""
    pick = random.Random(0)
    with path.open("w") as f:
        for i in range(count):
            row = {"id": i, "source": "synthetic",
                   "prompt_ids": [pick.randrange(vocab) for _ in range(pick.randint(20, 200))],
                   "response_ids": [pick.randrange(vocab) for _ in range(pick.randint(50, 256))]}
            f.write(json.dumps(row) + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", nargs="+", default=None,
                    help="gen-data JSONL rows (default: --synthetic-rows random rows, as good for timing random weights)")
    ap.add_argument("--synthetic-rows", type=int, default=1500)
    ap.add_argument("--max-len", type=int, default=768)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--rows", type=int, default=None, help="use only the first N rows (a quick check)")
    ap.add_argument("--device", default="cuda", help="cpu only checks that the script runs (wall-clock timings)")
    ap.add_argument("--batch-rows", type=int, default=32, help="drafter rows per step (the bundle's recipe: 32)")
    ap.add_argument("--num-layers", type=int, default=3, help="drafter layers (the bundle's: 3)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.setdefault("DFLASH_TFM_COMPILE", "0")  # as the trainers run
    torch.backends.cuda.matmul.allow_tf32 = True
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    timer = time_ms if dev.type == "cuda" else wall_ms
    cfg = ModelConfig.from_dict(SMOLLM2_135M)
    target = init_random_(build_model(cfg, dev, dtype, args.max_len + 16))
    raw = drafter_config_dict(cfg, num_layers=args.num_layers, block_size=16, mask_token_id=16,
                              target_layer_ids=[1, 14, 27], dtype=dtype)
    drafter = build_trainable_drafter(raw, target, seed=0)
    drafter.allocate(args.max_len + 16)
    result: dict = {}

    # ---- drafter
    if args.data is None:
        args.data = [write_synthetic_rows(Path(tempfile.mkdtemp()) / "rows.jsonl", args.synthetic_rows, cfg.vocab_size)]
    rows = read_rows(args.data, args.max_len, min_response=2)[: args.rows]
    features = TargetFeatures(target, raw["dflash_config"]["target_layer_ids"], args.max_len)
    sync()
    t0 = time.perf_counter()
    store = FeatureStore(features, [r.tokens for r in rows], with_hidden=True)
    sync()
    result["store_seconds"] = time.perf_counter() - t0
    result["store_gib"] = sum(t.numel() * t.element_size() for t in (store.features, store.hidden)) / 2**30
    print(f"feature store: {len(rows)} rows, {store.features.shape[0]} tokens, {result['store_gib']:.2f} GiB, "
          f"{result['store_seconds']:.1f} s")
    gen = torch.Generator().manual_seed(0)
    pick = random.Random(0)
    decay = torch.exp(-torch.arange(15, device=dev, dtype=torch.float32) / 7.0)
    optim = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-4, fused=dev.type == "cuda")
    autocast = torch.autocast(dev.type, dtype=dtype, enabled=dev.type == "cuda")
    batches = []
    t0 = time.perf_counter()
    for _ in range(args.iters):
        batch_rows = pick.sample(rows, args.batch_rows)
        batches.append((batch_rows, dflash_trainer.make_batch(batch_rows, 64, 16, gen, dev, args.max_len)))
    result["drafter_make_batch_ms"] = 1e3 * (time.perf_counter() - t0) / args.iters
    it = iter(range(1 << 30))

    def nth() -> tuple:
        return batches[next(it) % len(batches)]

    result["drafter_target_pass_ms"] = timer(lambda: features(nth()[1].tokens), args.iters, warmup=3)

    def gather() -> None:
        batch_rows, batch = nth()
        store.gather([r.tokens for r in batch_rows], batch.tokens.shape[1])

    result["drafter_store_gather_ms"] = timer(gather, args.iters, warmup=3)

    def drafter_step(distill: bool = False) -> None:
        batch_rows, batch = nth()
        hidden, feats = store.gather([r.tokens for r in batch_rows], batch.tokens.shape[1])
        dflash_trainer.train_step(drafter, (hidden if distill else None, feats), batch, decay, optim, 1.0, autocast)

    result["drafter_train_step_ms"] = timer(drafter_step, args.iters, warmup=5)
    result["drafter_train_step_distill_ms"] = timer(lambda: drafter_step(distill=True), args.iters, warmup=5)
    if args.profile and dev.type == "cuda":
        print_kernel_table(drafter_step, "drafter step (store gather + train_step)")
        print_kernel_table(lambda: drafter_step(distill=True), "drafter step with soft labels (--distill)")

    # ---- Weaver
    wrows = read_rows(args.data, args.max_len)[: args.rows]
    drafter.to(dtype)  # Weaver training loads the saved drafter in the target's dtype
    teacher = FrozenTeacher(target, drafter, 512, args.max_len)
    wcfg = WeaverConfig.from_dict(dict(d_model=cfg.hidden_size, d_embed=cfg.hidden_size, d_rank=384, num_layers=1,
                                       num_heads=6, mlp_dim=1024, K=15, candidate_pool_size=512, activation="swiglu"))
    weaver = new_weaver(wcfg, dev, torch.float32, seed=0)
    embed, lm_head = target.embed_tokens.float(), target.lm_head_weight.float()
    weaver.prepare(embed, lm_head)  # the rotary tables (train_weaver's first evaluation does this)
    woptim = torch.optim.AdamW(weaver.parameters(), lr=1e-4)
    sampler = PositionSampler(teacher, wrows, 4, random.Random(0))
    with torch.no_grad():
        result["weaver_teacher_target_pass_ms"] = timer(lambda: sampler.batch(32), args.iters, warmup=3)
        teacher.cache_rows(wrows, progress=True)
        result["weaver_teacher_store_ms"] = timer(lambda: sampler.batch(32), args.iters, warmup=3)
    path_batches = [sampler.batch(32) for _ in range(8)]
    result["weaver_train_step_ms"] = timer(
        lambda: weaver_trainer.train_step(weaver, path_batches[next(it) % 8], embed, lm_head, woptim, 0.0),
        args.iters, warmup=5)
    if args.profile and dev.type == "cuda":
        print_kernel_table(lambda: weaver_trainer.train_step(weaver, sampler.batch(32), embed, lm_head, woptim, 0.0),
                           "Weaver step (teacher from the store + train_step)")

    print("| part | ms |\n|---|---|")
    for key, value in result.items():
        if key.endswith("_ms"):
            print(f"| {key[:-3]} | {value:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
