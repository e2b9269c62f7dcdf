"""Train a DFlash drafter for a target on the target's own responses (MODELS.md, "Training recipe").

The frozen target's tap-layer outputs (no grad) are the context features: computed once for all rows when
they fit in memory (`FeatureStore`), else by a target pass over each batch. In every sequence `anchors_per_seq`
random response positions become blocks `[token at anchor, MASK x (B-1)]`; `block_forward` runs them all through
the drafter at once, each seeing the context strictly before its anchor plus its own block, never another block.
The loss is cross-entropy of block positions k = 1 .. B-1 against the true tokens anchor + k, weighted exp(-(k-1)/gamma)
(early positions matter most: a chain is accepted only up to its first miss); with `distill` the labels are the
target's own next-token distributions at anchor + k - 1 instead of its sampled tokens (soft labels from the
stored final hidden states and the shared lm_head: on rows sampled at T > 0 the sampled token is a noisy
stand-in for the distribution the drafter should match). The target's embeddings and
lm_head are shared, frozen and not saved; only the drafter's own weights train (fp32 master weights, the
target's dtype under autocast), with AdamW, linear warm-up then cosine decay, and gradient clipping.

Validation on held-out rows reports per-position acceptance (argmax == target token), the chain's expected
accepted length sum_k prod_{j<=k} acc_j (the tau-proxy; tau ~ 1 + it), and the mean accepted prefix of
whole blocks (exact greedy acceptance when the data is the target's greedy output).

    python -m dflash_tfm.train.dflash_trainer --model-path DIR --data data.jsonl --out drafter/ --num-layers 2
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from dflash_tfm.config import FULL_ATTENTION
from dflash_tfm.kernels.loss.linear_cross_entropy import linear_cross_entropy
from dflash_tfm.loading.loader import load_target, parse_dtype
from dflash_tfm.models.decoder import CausalLM
from dflash_tfm.spec.dflash import DFlashDrafter, load_dflash_drafter
from dflash_tfm.spec.dflash_config import drafter_config_dict
from dflash_tfm.train.dflash_checkpoint import build_trainable_drafter, default_mask_token_id, save_drafter
from dflash_tfm.train.dflash_forward import block_forward
from dflash_tfm.train.lr_schedule import SCHEDULES, check_schedule, lr_factor
from dflash_tfm.train.rows import TrainRow, read_rows
from dflash_tfm.train.shapes import padded_length
from dflash_tfm.train.step_budget import StepBudget
from dflash_tfm.train.tap_file import SavedTapFeatures
from dflash_tfm.train.target_features import FeatureStore, TargetFeatures, store_fits
from dflash_tfm.train.validation_split import split_validation

IGNORE = -100
DEFAULT_NUM_LAYERS = 2


@dataclass
class Batch:
    tokens: torch.Tensor  # [b, T] right-padded with 0
    anchors: torch.Tensor  # [b, N]
    labels: torch.Tensor  # [b, N, B-1], IGNORE beyond the sequence and for padding blocks


def make_batch(rows: list[TrainRow], anchors_per_seq: int, block_size: int, gen: torch.Generator,
               device: torch.device, max_length: int | None = None) -> Batch:
    """Up to `anchors_per_seq` distinct anchors per row, uniform over the response positions that have a
    next token; rows with fewer candidates repeat their first anchor with all labels ignored.

    With `max_length` the batch pads to `padded_length` (few distinct shapes), else to its longest row."""
    T = max(len(r.tokens) for r in rows)
    T = T if max_length is None else padded_length(T, max_length)
    tokens = torch.zeros(len(rows), T, dtype=torch.long)
    anchors = torch.zeros(len(rows), anchors_per_seq, dtype=torch.long)
    labels = torch.full((len(rows), anchors_per_seq, block_size - 1), IGNORE, dtype=torch.long)
    k = torch.arange(1, block_size)
    for i, row in enumerate(rows):
        L = len(row.tokens)
        tokens[i, :L] = torch.tensor(row.tokens)
        picked = torch.randperm(L - 1 - row.prompt_len, generator=gen)[:anchors_per_seq] + row.prompt_len
        anchors[i] = picked[0]
        anchors[i, : len(picked)] = picked
        pos = picked.view(-1, 1) + k
        labels[i, : len(picked)] = torch.where(pos < L, tokens[i, pos.clamp(max=T - 1)], IGNORE)
    return Batch(tokens.to(device), anchors.to(device), labels.to(device))


def block_loss_and_hits(
    drafter: DFlashDrafter, features: torch.Tensor, batch: Batch, decay: torch.Tensor,
    target_hidden: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weighted CE over the valid labels, plus per-label correctness [b, N, B-1] (False where invalid) and
    the validity mask. The lm_head runs on valid positions only. With `target_hidden` (the target's
    final-normed hidden states [b, T, H] of the batch) the CE is against the target's softmax at the position
    before each label (`soft_labels`) instead of the label token."""
    hidden = block_forward(drafter, features, batch.tokens, batch.anchors)
    valid = batch.labels != IGNORE
    logits = F.linear(hidden[valid], drafter.lm_head_weight).float()
    targets = batch.labels[valid]
    weights = decay.expand_as(batch.labels)[valid]
    soft = None if target_hidden is None else soft_labels(drafter, target_hidden, batch.anchors, valid)
    ce = F.cross_entropy(logits, targets if soft is None else soft, reduction="none")
    loss = (ce * weights).sum() / weights.sum().clamp(min=1e-9)
    hits = torch.zeros_like(valid)
    hits[valid] = logits.argmax(-1) == targets
    return loss, hits, valid


def block_loss(
    drafter: DFlashDrafter, features: torch.Tensor, batch: Batch, decay: torch.Tensor,
    target_hidden: torch.Tensor | None = None,
) -> torch.Tensor:
    """The training loss of `block_loss_and_hits` without the hits; on hard labels through
    `linear_cross_entropy`, which never holds the [n_valid, V] fp32 logits (the step's largest cost)."""
    if target_hidden is not None:
        return block_loss_and_hits(drafter, features, batch, decay, target_hidden)[0]
    hidden = block_forward(drafter, features, batch.tokens, batch.anchors)
    valid = batch.labels != IGNORE
    return linear_cross_entropy(hidden[valid], drafter.lm_head_weight, batch.labels[valid],
                                decay.expand_as(batch.labels)[valid])


@torch.no_grad()
def soft_labels(drafter: DFlashDrafter, target_hidden: torch.Tensor, anchors: torch.Tensor,
                valid: torch.Tensor) -> torch.Tensor:
    """The target's next-token distributions fp32 [n_valid, V] for the valid labels: label k of the block at
    anchor a is token a + k, which the target predicts from its hidden state at a + k - 1."""
    b, T = target_hidden.shape[:2]
    before = (anchors.unsqueeze(-1) + torch.arange(valid.shape[-1], device=anchors.device)).clamp(max=T - 1)
    rows = torch.arange(b, device=anchors.device).view(b, 1, 1).expand_as(before)
    h = target_hidden[rows[valid], before[valid]]
    return F.linear(h, drafter.lm_head_weight).float().softmax(-1)


def train_step(
    drafter: DFlashDrafter, features: tuple[torch.Tensor | None, torch.Tensor], batch: Batch, decay: torch.Tensor,
    optim: torch.optim.Optimizer, grad_clip: float, autocast: torch.autocast,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step on one batch -> (loss, gradient norm before clipping), both still on the device.
    `features` = (the target's final hidden states when distilling, else None; its tap features), in the
    target's own dtype, as at inference: outside autocast."""
    target_hidden, feats = features
    with autocast:
        loss = block_loss(drafter, feats, batch, decay, target_hidden)
    optim.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_([p for g in optim.param_groups for p in g["params"]], grad_clip)
    optim.step()
    return loss.detach(), grad_norm


# (rows, their padded tokens) -> (target final hidden states or None, target tap features)
BatchFeatures = Callable[[list[TrainRow], torch.Tensor], tuple[torch.Tensor | None, torch.Tensor]]


def batch_features(features: TargetFeatures, store: FeatureStore | None, with_hidden: bool) -> BatchFeatures:
    """Target outputs of a batch (final hidden states only `with_hidden`): gathered from the store when there
    is one (built with them), else a target pass over the tokens."""
    if store is not None:
        return lambda rows, tokens: store.gather([r.tokens for r in rows], tokens.shape[1])
    if with_hidden:
        return lambda rows, tokens: features.hidden_and_features(tokens)
    return lambda rows, tokens: (None, features(tokens))


@dataclass
class Validation:
    """Held-out metrics at one step. acc[k-1]: P(argmax == token) at block position k;
    accept_len = sum_k prod_{j<=k} acc_j; streak: mean accepted prefix over blocks whose B-1 labels exist."""

    step: int
    loss: float
    acc: list[float]
    accept_len: float
    streak: float


@torch.no_grad()
def validate(drafter: DFlashDrafter, features: BatchFeatures, rows: list[TrainRow], step: int, *, batch_size: int,
             anchors_per_seq: int, decay: torch.Tensor, seed: int, autocast: torch.autocast,
             max_length: int | None = None) -> Validation:
    """Same anchors every call (fixed seed), so validations at different steps compare like with like."""
    drafter.eval()
    gen = torch.Generator().manual_seed(seed)
    B = drafter.config.block_size
    hits_k = torch.zeros(B - 1)
    valid_k = torch.zeros(B - 1)
    loss_sum = weight_sum = streak_sum = blocks = 0.0
    for s in range(0, len(rows), batch_size):
        batch = make_batch(rows[s : s + batch_size], anchors_per_seq, B, gen, decay.device, max_length)
        _, feats = features(rows[s : s + batch_size], batch.tokens)
        with autocast:
            loss, hits, valid = block_loss_and_hits(drafter, feats, batch, decay)
        w = (decay.expand_as(batch.labels) * valid).sum().item()
        loss_sum, weight_sum = loss_sum + loss.item() * w, weight_sum + w
        hits_k += hits.sum((0, 1)).cpu()
        valid_k += valid.sum((0, 1)).cpu()
        full = valid.all(-1)
        streak_sum += hits.long().cumprod(-1).sum(-1)[full].sum().item()
        blocks += full.sum().item()
    drafter.train()
    acc = (hits_k / valid_k.clamp(min=1)).tolist()
    accept_len = sum(math.prod(acc[: k + 1]) for k in range(B - 1))
    return Validation(step, loss_sum / max(weight_sum, 1e-9), acc, accept_len, streak_sum / max(blocks, 1))


@dataclass
class TrainResult:
    out_dir: Path
    drafter: DFlashDrafter
    config: dict
    log: list[dict] = field(default_factory=list)  # {"step", "loss", "lr", "grad_norm"} every log_every
    validations: list[Validation] = field(default_factory=list)  # step 0 (untrained), every eval_every, last
    saved_step: int | None = None  # the step whose drafter is in out_dir (best validation accept_len)


def continue_drafter(path: str | Path, target: CausalLM, dtype: torch.dtype,
                     num_layers: int | None = None) -> tuple[dict, DFlashDrafter]:
    """A trainable drafter holding the weights of the drafter saved at `path`, read by the same strict loader
    as inference (`load_dflash_drafter`), and the raw config to save it with.

    `num_layers` above the saved count grows the drafter: the extra layers go on top (same type as the last)
    with zero output projections (`o_proj`, `mlp.down`), so each adds nothing to the residual stream and the
    grown drafter starts out computing exactly what the saved one does. Fewer layers than saved is an error."""
    saved = load_dflash_drafter(path, target, target.config, target.embed_tokens.device, dtype)
    if saved.config.shapes_logits:
        raise ValueError(f"{path} scales its embeddings or logits (input_embedding_scale, output_multiplier or "
                         "final_logit_softcapping), which the trainer's loss does not apply")
    raw = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    have = saved.config.num_layers
    if num_layers is not None and num_layers < have:
        raise ValueError(f"{path} has {have} layers; a drafter can grow from it, not shrink to {num_layers}")
    if num_layers is not None and num_layers > have:
        types = list(raw.get("layer_types") or [FULL_ATTENTION] * have)
        raw = dict(raw, num_hidden_layers=num_layers, layer_types=types + types[-1:] * (num_layers - have))
    drafter = build_trainable_drafter(raw, target, seed=0)
    params = dict(drafter.named_parameters())
    with torch.no_grad():
        for name, param in saved.named_parameters():
            params[name].copy_(param)
        for i in range(have, drafter.config.num_layers):
            params[f"layers.{i}.o_proj"].zero_()
            params[f"layers.{i}.mlp.down"].zero_()
    return raw, drafter


def train_dflash(
    target: str | Path | CausalLM,
    data_path: str | Path | list[str | Path],
    out_dir: str | Path,
    *,
    num_layers: int | None = None,
    block_size: int = 16,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int | None = None,
    layer_types: list[str] | None = None,
    sliding_window: int | None = None,
    causal_sliding_in_block: bool = True,
    steps: int = 1000,
    batch_size: int = 16,
    lr: float = 6e-4,
    warmup_frac: float = 0.04,
    schedule: str = "cosine",
    weight_decay: float = 0.0,
    grad_clip: float = 1.0,
    gamma: float = 7.0,
    anchors_per_seq: int = 64,
    max_len: int = 1024,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype = "auto",
    seed: int = 0,
    val_frac: float = 0.05,
    log_every: int = 10,
    eval_every: int | None = None,
    time_budget_s: float | None = None,
    init_from: str | Path | None = None,
    tokenizer: object | None = None,
    cache_features: bool | None = None,
    distill: bool = False,
    tap_features: str | Path | None = None,
    progress: bool = True,
) -> TrainResult:
    """Train a drafter for `target` (a local checkpoint path, or an already-built `CausalLM`: then `device`
    and `dtype` are its own and `tokenizer` may be given for the mask-token default) and save it to `out_dir`
    in the published layout, which `load_dflash_drafter` reads back.

    `mask_token_id` None: `default_mask_token_id` (the tokenizer's mask or an unused special id). With
    held-out rows (`val_frac` > 0) the drafter of the best validation accept_len is saved (step 0 included),
    otherwise the last one; `train_log.jsonl` holds every logged step and validation. `eval_every` None:
    10 validations per run. `time_budget_s` lowers `steps` after the first steps so the whole schedule fits
    (`StepBudget`). `num_layers` None: DEFAULT_NUM_LAYERS for a new drafter, the saved count with `init_from`.
    `init_from`: continue from a saved drafter directory (its config wins over the other shape arguments; a
    larger `num_layers` grows it, `continue_drafter`; the optimizer starts fresh, warm-up included), so a run
    can span several time-limited jobs.
    `cache_features`: run the target once over all rows and keep its features (`FeatureStore`); None = when
    they fit (`store_fits`). `distill`: soft labels, the target's next-token distributions (`soft_labels`;
    validation still scores against the data's tokens, so runs with and without compare). `tap_features`: a file
    of the rows' tap features saved by `gen-data --save-taps` (`tap_file.py`), used instead of a target pass.
    `schedule`: the learning-rate shape (`lr_schedule.py`).
    `result.drafter` is the last state, `result.saved_step` says which was saved.
    """
    if distill and tap_features is not None:
        raise ValueError("distillation needs the target's final hidden states, which a tap feature file does not "
                         "hold: drop the tap feature file to compute them")
    check_schedule(schedule)
    budget = StepBudget(steps, time_budget_s)
    rows = read_rows(data_path, max_len, min_response=2)  # before the target loads: bad data fails fast
    val_rows, train_rows = split_validation(rows, lambda r: r.key, val_frac)
    if not train_rows:
        raise ValueError(f"no usable training rows in {data_path} (need >= 2 response tokens within max_len)")
    if isinstance(target, CausalLM):
        model = target
        device, dtype = model.embed_tokens.device, model.embed_tokens.dtype
    else:
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = parse_dtype(("bfloat16" if device.type == "cuda" else "float32") if dtype == "auto" else dtype)
        loaded = load_target(target, device, dtype, max_positions=max_len, progress=progress)
        model, tokenizer = loaded.model, tokenizer or loaded.tokenizer
    model.requires_grad_(False).eval()
    tcfg = model.config
    if mask_token_id is None:
        mask_token_id = default_mask_token_id(tokenizer, tcfg.vocab_size)
    if init_from is None:
        raw = drafter_config_dict(
            tcfg, num_layers=num_layers or DEFAULT_NUM_LAYERS, block_size=block_size, mask_token_id=mask_token_id,
            target_layer_ids=target_layer_ids, layer_types=layer_types, sliding_window=sliding_window,
            causal_sliding_in_block=causal_sliding_in_block, dtype=dtype,
        )
        drafter = build_trainable_drafter(raw, model, seed)
    else:
        raw, drafter = continue_drafter(init_from, model, dtype, num_layers)
        block_size = drafter.config.block_size
    drafter.allocate(max_len + block_size)  # RoPE table for every block position
    target_features = TargetFeatures(model, drafter.config.target_layer_ids, max_len)
    width = tcfg.hidden_size * (len(drafter.config.target_layer_ids) + distill)
    if tap_features is not None:
        saved = SavedTapFeatures(tap_features)
        saved.check_fits(drafter.config.target_layer_ids, width)
        store = saved.store([r.key for r in rows], [r.tokens for r in rows], device)
    else:
        if cache_features is None:
            cache_features = store_fits(sum(len(r.tokens) for r in rows), width, dtype, device)
        store = FeatureStore(target_features, [r.tokens for r in rows], with_hidden=distill, progress=progress) \
            if cache_features else None
    features = batch_features(target_features, store, with_hidden=distill)

    decay = torch.exp(-torch.arange(block_size - 1, device=device, dtype=torch.float32) / gamma)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay,
                              fused=device.type == "cuda")
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, budget.schedule(lambda step, total: lr_factor(step, total, schedule, warmup_frac)))
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    result = TrainResult(Path(out_dir), drafter, raw)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed + 2)
    epoch: list[int] = []
    bar = tqdm(total=steps, desc="train-dflash", unit="step", disable=not progress)
    with (Path(out_dir) / "train_log.jsonl").open("w", encoding="utf-8") as log_file:

        def record(entry: dict) -> None:
            log_file.write(json.dumps(entry) + "\n")
            log_file.flush()

        def run_validation(step: int) -> None:
            """Validate, and save the drafter when its accept_len is the best so far: a run that starts to
            overfit, or is cut short by a time limit, leaves its best drafter behind."""
            if not val_rows:
                return
            v = validate(drafter, features, val_rows, step, batch_size=batch_size, anchors_per_seq=anchors_per_seq,
                         decay=decay, seed=seed + 1, autocast=autocast, max_length=max_len)
            best = max((u.accept_len for u in result.validations), default=-1.0)
            result.validations.append(v)
            record({"validation": v.__dict__})
            if v.accept_len > best:
                save_drafter(drafter, raw, out_dir, dtype)
                result.saved_step = step
            bar.write(f"step {step}: val loss {v.loss:.3f}  acc@1 {v.acc[0]:.3f}  accept_len {v.accept_len:.2f}  "
                      f"streak {v.streak:.2f}" + ("  (saved)" if result.saved_step == step else ""))

        run_validation(0)
        budget.begin()
        done = 0
        while done < budget.steps:
            if len(epoch) < batch_size:
                epoch += torch.randperm(len(train_rows), generator=gen).tolist()
            picked, epoch = epoch[:batch_size], epoch[batch_size:]
            batch_rows = [train_rows[i] for i in picked]
            batch = make_batch(batch_rows, anchors_per_seq, block_size, gen, device, max_len)
            loss, grad_norm = train_step(drafter, features(batch_rows, batch.tokens), batch, decay, optim, grad_clip,
                                         autocast)
            sched.step()
            done += 1
            last = budget.step_done(done, bar)
            if done % log_every == 0 or last:
                entry = {"step": done, "loss": loss.item(), "lr": sched.get_last_lr()[0], "grad_norm": grad_norm.item()}
                result.log.append(entry)
                record(entry)
                bar.set_postfix(loss=f"{entry['loss']:.3f}", lr=f"{entry['lr']:.2e}")
            if done % (eval_every or max(1, budget.steps // 10)) == 0 or last:
                run_validation(done)
    bar.close()
    if not val_rows:
        save_drafter(drafter, raw, out_dir, dtype)
        result.saved_step = budget.steps
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-tfm train-dflash", description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None, help="target: HF directory or .gguf (default: embedded SmolLM2)")
    p.add_argument("--data", nargs="+", required=True, type=Path, help="JSONL file(s) from dflash_tfm.train.data")
    p.add_argument("--out", required=True, type=Path, help="drafter output directory")
    p.add_argument("--num-layers", type=int, default=None,
                   help=f"default {DEFAULT_NUM_LAYERS}; with --init-from: the saved count, more grows the drafter")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--target-layer-ids", type=int, nargs="+", default=None, help="default: the reference rule")
    p.add_argument("--mask-token-id", type=int, default=None, help="default: tokenizer mask or an unused special")
    p.add_argument("--layer-types", nargs="+", default=None, choices=["full_attention", "sliding_attention"])
    p.add_argument("--sliding-window", type=int, default=None)
    p.add_argument("--bidirectional-sliding", action="store_true", help="sliding layers non-causal inside a block")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup-frac", type=float, default=0.04)
    p.add_argument("--schedule", default="cosine", choices=SCHEDULES,
                   help="learning-rate shape (train/lr_schedule.py); constant, then a cosine run from its drafter: "
                        "one WSD cycle in two jobs")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--gamma", type=float, default=7.0, help="loss weight exp(-(k-1)/gamma) of block position k")
    p.add_argument("--anchors-per-seq", type=int, default=64)
    p.add_argument("--max-len", type=int, default=1024, help="prompt + response tokens kept per row")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--val-frac", type=float, default=0.05)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=None)
    p.add_argument("--time-budget-minutes", type=float, default=None,
                   help="fit --steps to this wall-clock budget (measured over the first steps)")
    p.add_argument("--init-from", type=Path, default=None,
                   help="continue training this saved drafter directory (its config wins over the shape flags)")
    p.add_argument("--no-feature-cache", action="store_true",
                   help="re-run the target every step instead of keeping its features of all rows in memory")
    p.add_argument("--tap-features", type=Path, default=None,
                   help="the rows' tap features saved by `gen-data --save-taps` (instead of a target pass)")
    p.add_argument("--distill", action="store_true",
                   help="soft labels: the target's next-token distributions instead of the data's tokens")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from dflash_tfm.errors import CheckpointError

    # Batch shapes change every step; lazily compiling the layers' small fused helpers (layers/compile.py)
    # for each new shape would cost more than it saves.
    os.environ.setdefault("DFLASH_TFM_COMPILE", "0")

    try:
        result = train_dflash(
            args.model_path, args.data, args.out, num_layers=args.num_layers, block_size=args.block_size,
            target_layer_ids=args.target_layer_ids, mask_token_id=args.mask_token_id, layer_types=args.layer_types,
            sliding_window=args.sliding_window, causal_sliding_in_block=not args.bidirectional_sliding,
            steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup_frac=args.warmup_frac,
            schedule=args.schedule, weight_decay=args.weight_decay, grad_clip=args.grad_clip, gamma=args.gamma,
            anchors_per_seq=args.anchors_per_seq, max_len=args.max_len, device=args.device, dtype=args.dtype,
            seed=args.seed, val_frac=args.val_frac, log_every=args.log_every, eval_every=args.eval_every,
            time_budget_s=None if args.time_budget_minutes is None else 60 * args.time_budget_minutes,
            init_from=args.init_from, cache_features=False if args.no_feature_cache else None,
            distill=args.distill, tap_features=args.tap_features, progress=not args.no_progress,
        )
    except (FileNotFoundError, CheckpointError, ValueError) as e:
        print(f"dflash-tfm train-dflash: error: {e}", file=sys.stderr)
        return 2
    saved = next((v for v in result.validations if v.step == result.saved_step), None)
    summary = "" if saved is None else f": val accept_len {saved.accept_len:.2f}, streak {saved.streak:.2f}"
    print(f"saved the step-{result.saved_step} drafter to {result.out_dir}{summary}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
