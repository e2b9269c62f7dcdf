"""Train a Weaver for a frozen target + DFlash drafter pair (MODELS.md "Weaver", training).

What is learnt: at a committed length L the drafter has seen the context [0, L) and drafts a block whose root is
the token at L. Along the TRUE continuation (the target-generated tokens at L+1 … L+K of a training row) Weaver's
node at depth d (path tokens L … L+d) re-scores the depth-(d + 1) candidate pool (top ``pool_size`` DFlash
logits); the loss is KL(p_target ‖ q_weaver) over that pool, where p_target is the target's next-token
distribution at position L+d restricted to the pool and renormalised (+ ``tv_weight`` · total variation).
Those are exactly the quantities the tree search ranks children by, so lowering them raises acceptance.

Why it is built this way:
- one target forward over prompt + response gives, for every position, the drafter context (tap outputs), the
  prefix row ``h_target`` (final-normed hidden at L − 1) and p_target along the path (the path tokens ARE the
  response tokens), so several positions of a row share one target pass;
- the drafter drafts the blocks of all positions of a row in one pass (``block_forward``, the drafter trainer's
  forward, held equal to inference ``draft`` by tests/train/test_train_dflash.py); the Weaver scores all positions' chains in
  one pass through its own modules (``path_log_probs``), the same numbers as its inference calls
  ``encode_prefix`` / ``step`` / ``child_logits`` on a chain tree (node d's ancestors = the path root … d) —
  a test compares the two, so training and inference cannot drift apart;
- ``prepare`` precomputes ``token_table`` and ``W_res`` without gradients (inference needs them once); training
  re-derives both from the parameters once per optimizer step, so ``token_in``, ``embed_norm`` and
  ``lm_head_query_in`` are learnt through the very tables inference uses;
- a fresh Weaver starts with ``lm_head_query_in = 0``: its re-scoring is then exactly the DFlash marginals, and
  training can only move it away from that baseline where the target says so.

Data: JSONL rows ``{"prompt_ids": [...], "response_ids": [...]}`` (target-generated responses; other fields are
ignored). Output: the published ``torch.save`` format ``{"config", "state_dict", "metadata"}`` that
``load_weaver`` reads strictly, plus ``<out>.json`` with the arguments and validation history.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from dflash_tfm.models.decoder import CausalLM
from dflash_tfm.spec.dflash import DFlashDrafter
from dflash_tfm.spec.weaver import SPECULATOR_KIND, Weaver, WeaverConfig, WeaverNorm, load_weaver
from dflash_tfm.train.dflash_forward import block_forward
from dflash_tfm.train.lr_schedule import SCHEDULES, check_schedule, lr_factor
from dflash_tfm.train.rows import TrainRow, read_rows
from dflash_tfm.train.shapes import padded_length
from dflash_tfm.train.step_budget import StepBudget
from dflash_tfm.train.target_features import FeatureStore, TargetFeatures, store_fits
from dflash_tfm.train.validation_split import split_validation

MAX_VAL_POSITIONS = 512
VAL_ROWS_PER_PASS = 8  # rows per target pass when the held-out positions are computed


@dataclass
class PathBatch:
    """Frozen-model outputs for B draft positions (K = block size − 1 depths, P = pool size).

    h_target [B, H] and h_dflash [B, K, H] feed Weaver's prefix; tokens [B, K] are the path nodes (depth d =
    the row's token L + d); valid [B, K] marks depths whose node lies inside the row; pool_ids / pool_logits
    [B, K, P] are the DFlash candidates of depth d + 1; target_logp [B, K, P] is log p_target over that pool
    (renormalised) and target_top1 [B, K] the target's argmax over the full vocabulary.
    """

    h_target: torch.Tensor
    h_dflash: torch.Tensor
    tokens: torch.Tensor
    valid: torch.Tensor
    pool_ids: torch.Tensor
    pool_logits: torch.Tensor
    target_logp: torch.Tensor
    target_top1: torch.Tensor


class FrozenTeacher:
    """The frozen target and drafter: turns rows and their draft positions into a :class:`PathBatch`."""

    def __init__(self, target: CausalLM, drafter: DFlashDrafter, pool_size: int, max_seq_len: int) -> None:
        self.target, self.drafter = target, drafter
        self.block = drafter.config.block_size
        self.features = TargetFeatures(target, drafter.config.target_layer_ids, max_seq_len)
        self.max_seq_len = max_seq_len
        self.store: FeatureStore | None = None
        self.pool = min(pool_size, target.config.vocab_size)
        self.device = target.embed_tokens.device
        if drafter.max_len < max_seq_len + self.block:
            drafter.allocate(max_seq_len + self.block)

    def cache_rows(self, rows: list[TrainRow], progress: bool) -> None:
        """Run the target once over `rows` and keep its outputs (`FeatureStore`): `paths` then gathers them."""
        self.store = FeatureStore(self.features, [row.tokens for row in rows], with_hidden=True, progress=progress)

    @torch.no_grad()
    def paths(self, rows: list[TrainRow], positions: list[list[int]]) -> PathBatch:
        """Positions L of row i (prompt_len <= L < len(row.tokens)) -> one PathBatch, rows in order, each row's
        positions in increasing order.

        One target pass over all rows (right-padded to `padded_length`: causal attention and the GDN recurrence
        never let a pad token reach an earlier position), or its outputs gathered from `store` (`cache_rows`), and
        one drafter block forward for every position (the drafter trainer's, equal to `draft` at each L); a row
        with fewer positions repeats its last one, dropped after.
        """
        R, K = len(rows), self.block - 1
        lengths = torch.tensor([len(r.tokens) for r in rows], device=self.device)
        T, n = padded_length(int(lengths.max()), self.max_seq_len), max(len(p) for p in positions)
        ids = torch.zeros(R, T, dtype=torch.long, device=self.device)
        for i, row in enumerate(rows):
            ids[i, : len(row.tokens)] = torch.tensor(row.tokens)
        anchors = torch.tensor([sorted(p) + [max(p)] * (n - len(p)) for p in positions], device=self.device)  # [R, n]
        real = (torch.arange(n) < torch.tensor([len(p) for p in positions])[:, None]).view(-1).to(self.device)
        if self.store is not None and all(row.tokens in self.store for row in rows):
            hidden, feats = self.store.gather([row.tokens for row in rows], T)
        else:
            hidden, feats = self.features.hidden_and_features(ids)
        h_dflash = block_forward(self.drafter, feats, ids, anchors)  # [R, n, K, H]
        node_pos = anchors[..., None] + torch.arange(K, device=self.device)  # [R, n, K]: depth-d node positions
        valid = node_pos < lengths[:, None, None]
        node_pos = torch.minimum(node_pos, (lengths - 1)[:, None, None])
        rows_of = torch.arange(R, device=self.device)[:, None]
        target_logits = self.target.logits(hidden[rows_of[..., None], node_pos])  # [R, n, K, V]: child of node d
        draft_logits = F.linear(h_dflash, self.drafter.lm_head_weight).float()
        pool_logits, pool_ids = draft_logits.topk(self.pool, dim=-1)
        flat = lambda t: t.flatten(0, 1)[real]  # noqa: E731  [R, n, ...] -> the real positions' rows
        return PathBatch(
            h_target=flat(hidden[rows_of, anchors - 1]), h_dflash=flat(h_dflash), tokens=flat(ids[rows_of[..., None], node_pos]),
            valid=flat(valid), pool_ids=flat(pool_ids), pool_logits=flat(pool_logits),
            target_logp=flat(target_logits.gather(-1, pool_ids).log_softmax(-1)), target_top1=flat(target_logits.argmax(-1)),
        )


def _chain_mask(K: int, device: torch.device) -> torch.Tensor:
    """[P + K, P + K] bool, True = visible, for P = K + 1 prefix rows followed by a K-node chain: prefix rows
    attend causally among themselves (``encode_prefix``); node d attends to every prefix row and to nodes 0 … d
    (its inclusive ancestors on the chain, as ``step`` sees them)."""
    P = K + 1
    mask = torch.ones(P + K, P + K, dtype=torch.bool, device=device).tril()
    mask[P:, :P] = True
    return mask


def path_log_probs(weaver: Weaver, batch: PathBatch) -> torch.Tensor:
    """log q_weaver over each depth's pool along the true paths, [B, K, P] fp32, for all B positions in one pass.

    Each position is one sequence of its K + 1 prefix rows then its K path nodes under `_chain_mask`, through the
    Weaver's own modules (norms, projections, blocks, ``child_logits``): the same numbers as ``encode_prefix``
    followed by node-by-node ``step`` calls, which tests/train/test_train_weaver.py checks, without a Python
    loop over positions (the loop made training launch-bound).
    """
    cfg = weaver.config
    B, K = batch.tokens.shape
    P, T = cfg.prefix_len, cfg.prefix_len + K
    dtype = weaver.token_in.weight.dtype
    feats = torch.cat([batch.h_target[:, None], batch.h_dflash], 1).to(dtype)  # [B, P, d_model]
    prefix = weaver.proposal_in(weaver.output_norm(feats))
    nodes = weaver.token_table[batch.tokens]  # [B, K, d_rank]
    depths = torch.arange(K, device=nodes.device)
    if not cfg.rotary:
        prefix = torch.cat([prefix[:, :1], prefix[:, 1:] + weaver.pos_emb], 1)
        nodes = nodes + weaver.pos_emb[depths.clamp(max=cfg.K - 1)]
    x = torch.cat([prefix, nodes], 1).flatten(0, 1)  # [B·T, d_rank]
    rope = weaver._rope(torch.cat([torch.arange(P, device=x.device), depths.clamp(max=cfg.K) + 1]))
    rope = None if rope is None else (rope[0].repeat(B, 1), rope[1].repeat(B, 1))
    mask = _chain_mask(K, x.device)
    for block in weaver.blocks:
        q, k, v = (t.view(B, T, cfg.num_heads, cfg.head_dim) for t in block.project_qkv(x, rope))
        scores = torch.einsum("bwhd,bthd->bhwt", q.float(), k.float()) * cfg.head_dim**-0.5
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1).to(v.dtype)
        x = block.finish(x, torch.einsum("bhwt,bthd->bwhd", probs, v).reshape(B * T, -1))
    queries = weaver.out_norm(x).view(B, T, -1)[:, P:]
    logits = weaver.child_logits(queries.flatten(0, 1), batch.pool_ids.flatten(0, 1), batch.pool_logits.flatten(0, 1))
    return logits.log_softmax(-1).view(B, K, -1)


def path_losses(logq: torch.Tensor, batch: PathBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean KL(p_target ‖ q) and mean total variation over the valid (position, depth) pairs."""
    p = batch.target_logp.exp()
    kl = (p * (batch.target_logp - logq)).sum(-1)
    tv = 0.5 * (p - logq.exp()).abs().sum(-1)
    mask = batch.valid.float()
    return (kl * mask).sum() / mask.sum(), (tv * mask).sum() / mask.sum()


def _top1(logq: torch.Tensor, batch: PathBatch) -> torch.Tensor:
    """Fraction of valid depths whose best pool candidate is the target's argmax token."""
    best = batch.pool_ids.gather(-1, logq.argmax(-1, keepdim=True)).squeeze(-1)
    return ((best == batch.target_top1) & batch.valid).sum() / batch.valid.sum()


@torch.no_grad()
def evaluate(weaver: Weaver, batches: list[PathBatch], embed: torch.Tensor, lm_head: torch.Tensor) -> dict[str, float]:
    """Held-out KL and top-1 agreement of Weaver (with the exact inference tables from ``prepare``) and, as the
    baseline Weaver has to beat, of the DFlash marginals alone."""
    weaver.prepare(embed, lm_head)
    totals = dict.fromkeys(("kl", "top1", "dflash_kl", "dflash_top1"), 0.0)
    count = 0.0
    for batch in batches:
        n = float(batch.valid.sum())
        logq, base = path_log_probs(weaver, batch), batch.pool_logits.log_softmax(-1)
        totals["kl"] += float(path_losses(logq, batch)[0]) * n
        totals["top1"] += float(_top1(logq, batch)) * n
        totals["dflash_kl"] += float(path_losses(base, batch)[0]) * n
        totals["dflash_top1"] += float(_top1(base, batch)) * n
        count += n
    return {k: v / count for k, v in totals.items()}


def new_weaver(cfg: WeaverConfig, device: torch.device, dtype: torch.dtype, seed: int) -> Weaver:
    """A fresh Weaver: linear layers at PyTorch's default init, norms at the identity (w = 1, b = 0),
    ``pos_emb`` ~ N(0, 0.02), and ``lm_head_query_in = 0`` so that it starts as the DFlash marginals."""
    torch.manual_seed(seed)
    weaver = Weaver(cfg)
    with torch.no_grad():
        for module in weaver.modules():
            if isinstance(module, WeaverNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()
        if not cfg.rotary:
            weaver.pos_emb.normal_(0.0, 0.02)
        weaver.lm_head_query_in.weight.zero_()
    return weaver.to(device=device, dtype=dtype)


def attach_differentiable_tables(weaver: Weaver, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
    """``token_table`` and ``W_res`` as functions of the current parameters (what ``prepare`` computes
    without gradients), for one optimizer step."""
    weaver.token_table = weaver.token_in(weaver.embed_norm(embed))
    weaver.w_res = lm_head @ weaver.lm_head_query_in.weight


def checkpoint_payload(weaver: Weaver, variant: int, dtype: torch.dtype = torch.float32) -> dict:
    """The published format, tensors in ``dtype``. Variant 2 omits ``activation``/``rope_base``: the original
    class of that era did not accept them (``load_weaver`` reads the activation off the fc1/fc2 key names)."""
    cfg = weaver.config
    config = {k: getattr(cfg, k) for k in ("d_model", "d_embed", "d_rank", "num_layers", "num_heads", "mlp_dim", "K",
                                           "candidate_pool_size", "encoder_mode", "score_head")}
    if variant == 1:
        config.update(activation="swiglu", rope_base=cfg.rope_base)
    state = {k: v.detach().to("cpu", dtype).clone() for k, v in weaver.state_dict().items()}
    return {"config": config, "state_dict": state, "metadata": {"speculator_kind": SPECULATOR_KIND}}


def train_step(weaver: Weaver, batch: PathBatch, embed: torch.Tensor, lm_head: torch.Tensor,
               optimizer: torch.optim.Optimizer, tv_weight: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One optimizer step (tables re-derived from the parameters, gradient clipping at 1.0) -> (loss, kl, tv),
    still on the device."""
    attach_differentiable_tables(weaver, embed, lm_head)
    kl, tv = path_losses(path_log_probs(weaver, batch), batch)
    loss = kl + tv_weight * tv
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(weaver.parameters(), 1.0)
    optimizer.step()
    return loss.detach(), kl.detach(), tv.detach()


@dataclass
class WeaverTrainResult:
    """Where the checkpoint went and the held-out metrics before and after training (see :func:`evaluate`)."""

    out_path: Path
    val_before: dict[str, float]
    val_after: dict[str, float]
    history: list[dict[str, float]]


def _sample_positions(row: TrainRow, n: int, rng: random.Random) -> list[int]:
    """Up to n distinct draft positions L of a row: the response's tokens (L >= prompt_len, so L − 1 exists)."""
    candidates = range(row.prompt_len, len(row.tokens))
    return rng.sample(candidates, min(n, len(candidates)))


def held_out_batches(teacher: FrozenTeacher, rows: list[TrainRow], per_row: int, rng: random.Random) -> list[PathBatch]:
    """Fixed validation positions (at most MAX_VAL_POSITIONS), computed once and reused at every evaluation."""
    picked: list[tuple[TrainRow, list[int]]] = []
    budget = MAX_VAL_POSITIONS
    for row in rows:
        if budget <= 0:
            break
        picked.append((row, _sample_positions(row, min(per_row, budget), rng)))
        budget -= len(picked[-1][1])
    return [teacher.paths([r for r, _ in group], [p for _, p in group])
            for group in (picked[i : i + VAL_ROWS_PER_PASS] for i in range(0, len(picked), VAL_ROWS_PER_PASS))]


class PositionSampler:
    """Training batches: rows in shuffled epochs, ``per_row`` random positions from each (one target pass for
    all rows of a batch)."""

    def __init__(self, teacher: FrozenTeacher, rows: list[TrainRow], per_row: int, rng: random.Random) -> None:
        self.teacher, self.rows, self.per_row, self.rng = teacher, rows, per_row, rng
        self.order: list[TrainRow] = []

    def batch(self, size: int) -> PathBatch:
        rows, positions = [], []
        while size > 0:
            if not self.order:
                self.order = list(self.rows)
                self.rng.shuffle(self.order)
            rows.append(self.order.pop())
            positions.append(_sample_positions(rows[-1], min(self.per_row, size), self.rng))
            size -= len(positions[-1])
        return self.teacher.paths(rows, positions)


def train_weaver(
    target: CausalLM, drafter: DFlashDrafter, data_path: str | Path | list[str | Path], out_path: str | Path, *,
    d_rank: int, num_heads: int, mlp_dim: int, num_layers: int = 1, variant: int = 1, pool_size: int = 512, steps: int,
    batch_size: int, lr: float = 2e-4, schedule: str = "wsd", tv_weight: float = 0.0,
    device: str | torch.device | None = None, dtype: torch.dtype = torch.float32, seed: int = 0,
    val_frac: float = 0.02, log_every: int = 20, eval_every: int = 0, positions_per_row: int = 4,
    max_seq_len: int = 2048, time_budget_s: float | None = None, init_from: str | Path | None = None,
    cache_features: bool | None = None, progress: bool = True, save_dtype: torch.dtype = torch.float32,
) -> WeaverTrainResult:
    """Train a Weaver of the given shape for ``target`` + ``drafter`` (both frozen) and save it to ``out_path``.

    A batch holds ``batch_size`` draft positions, ``positions_per_row`` per row. ``device`` defaults to the
    target's; ``dtype`` is the Weaver's training dtype (keep fp32: AdamW master weights); the file is saved in
    ``save_dtype`` (bfloat16 halves it; ``load_weaver`` casts to the inference dtype either way). ``val_frac`` of the rows (at least one; chosen by id, ``split_validation``) is held
    out and evaluated before training, every ``eval_every`` steps (0: never in between) and at the end. AdamW (0.9,
    0.95), weight decay 0.01 on matrices only, gradient clipping at 1.0. Callers on CUDA should set
    ``DFLASH_TFM_COMPILE=0`` (``main`` does): every row has a new length, and compiling the frozen models' fused
    helpers per shape costs more than it saves. ``time_budget_s`` fits ``steps`` to a wall-clock budget
    (``StepBudget``). ``init_from`` continues a saved Weaver (its shape wins over the shape arguments; the optimizer
    starts fresh), so a run can span several time-limited jobs. ``cache_features``: run the target once over all
    rows and keep its outputs (``FrozenTeacher.cache_rows``); None = when they fit (``store_fits``).
    """
    if variant not in (1, 2):
        raise ValueError(f"variant must be 1 (swiglu, rotary) or 2 (gelu, pos_emb), got {variant}")
    check_schedule(schedule)
    if steps < 1 or batch_size < 1 or positions_per_row < 1 or log_every < 1:
        raise ValueError("steps, batch_size, positions_per_row and log_every must be >= 1")
    device = torch.device(device) if device is not None else target.embed_tokens.device
    if device.type != target.embed_tokens.device.type:
        raise ValueError(f"Weaver must train on the target's device ({target.embed_tokens.device}), not {device}")
    budget = StepBudget(steps, time_budget_s)
    rng = random.Random(seed)
    rows = read_rows(data_path, max_seq_len)
    # At least one row is held out, even at val_frac 0 (the smallest positive fraction keeps one); a single row
    # is both.
    val_rows, train_rows = split_validation(rows, lambda r: r.key, max(val_frac, 1e-9))
    val_rows = val_rows or train_rows
    teacher = FrozenTeacher(target, drafter, pool_size, max(len(r.tokens) for r in rows))
    if cache_features is None:
        width = target.config.hidden_size * (1 + len(drafter.config.target_layer_ids))
        cache_features = store_fits(sum(len(r.tokens) for r in rows), width, target.embed_tokens.dtype, device)
    if cache_features:
        teacher.cache_rows(rows, progress)
    embed = target.embed_tokens.detach().to(device, dtype)
    lm_head = target.lm_head_weight.detach().to(device, dtype)
    if init_from is None:
        cfg = WeaverConfig.from_dict(dict(  # the same checks a loaded checkpoint gets
            d_model=target.config.hidden_size, d_embed=embed.shape[1], d_rank=d_rank, num_layers=num_layers,
            num_heads=num_heads, mlp_dim=mlp_dim, K=drafter.config.block_size - 1, candidate_pool_size=teacher.pool,
            activation="swiglu" if variant == 1 else "gelu",
        ))
        weaver = new_weaver(cfg, device, dtype, seed)
    else:  # the strict inference loader: a checkpoint that does not fit target + drafter fails here
        weaver = load_weaver(init_from, target, target.config, drafter.config.block_size, device, dtype)
        weaver.requires_grad_(True).train()
        cfg, variant = weaver.config, 1 if weaver.config.rotary else 2
        if cfg.candidate_pool_size != teacher.pool:
            raise ValueError(f"{init_from} has a candidate pool of {cfg.candidate_pool_size}, this run {teacher.pool}")
    val_batches = held_out_batches(teacher, val_rows, positions_per_row, rng)
    val_before = evaluate(weaver, val_batches, embed, lm_head)
    history: list[dict[str, float]] = [{"step": 0, **{f"val_{k}": v for k, v in val_before.items()}}]

    sampler = PositionSampler(teacher, train_rows, positions_per_row, rng)
    groups = [{"params": [p for p in weaver.parameters() if p.dim() >= 2], "weight_decay": 0.01},
              {"params": [p for p in weaver.parameters() if p.dim() < 2], "weight_decay": 0.0}]  # norms, biases
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, budget.schedule(lambda step, total: lr_factor(step, total, schedule)))
    bar = tqdm(total=steps, desc="train-weaver", unit="step", disable=not progress)
    budget.begin()
    step = 0
    while step < budget.steps:
        step += 1
        loss, kl, tv = train_step(weaver, sampler.batch(batch_size), embed, lm_head, optimizer, tv_weight)
        scheduler.step()
        last = budget.step_done(step, bar)
        if step % log_every == 0 or last:
            record = {"step": step, "loss": loss.item(), "kl": kl.item(), "tv": tv.item(),
                      "lr": optimizer.param_groups[0]["lr"]}
            if (eval_every and step % eval_every == 0) or last:
                record.update({f"val_{k}": v for k, v in evaluate(weaver, val_batches, embed, lm_head).items()})
            history.append(record)
            bar.set_postfix({k: f"{v:.3g}" for k, v in record.items() if k != "step"})
    bar.close()
    val_after = {k.removeprefix("val_"): v for k, v in history[-1].items() if k.startswith("val_")}

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    payload = checkpoint_payload(weaver, variant, save_dtype)
    tmp = out_path.with_name(out_path.name + ".tmp")
    torch.save(payload, tmp)
    tmp.replace(out_path)  # a crash mid-write never leaves a truncated checkpoint under the real name
    summary = {"config": payload["config"], "variant": variant, "steps": budget.steps, "steps_requested": steps, "batch_size": batch_size,
               "positions_per_row": positions_per_row, "lr": lr, "schedule": schedule, "tv_weight": tv_weight,
               "seed": seed, "train_rows": len(train_rows), "val_rows": len(val_rows), "history": history}
    out_path.with_name(out_path.name + ".json").write_text(json.dumps(summary, indent=2))
    return WeaverTrainResult(out_path, val_before, val_after, history)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-tfm train-weaver", description=__doc__.splitlines()[0])
    p.add_argument("--target-path", "--model-path", dest="target_path", default=None,
                   help="target HF dir or .gguf (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--draft-model-path", required=True, help="trained DFlash drafter directory (kept frozen)")
    p.add_argument("--data", nargs="+", required=True, type=Path,
                   help="JSONL file(s) of {prompt_ids, response_ids} generated by the target (dflash_tfm.train.data)")
    p.add_argument("--out", required=True, help="Weaver checkpoint to write (.pth)")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=32, help="draft positions per optimizer step")
    p.add_argument("--positions-per-row", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--schedule", default="wsd", choices=SCHEDULES)
    p.add_argument("--d-rank", type=int, default=384)
    p.add_argument("--num-heads", type=int, default=6)
    p.add_argument("--mlp-dim", type=int, default=1024)
    p.add_argument("--num-layers", type=int, default=1)
    p.add_argument("--variant", type=int, default=1, choices=[1, 2])
    p.add_argument("--pool-size", type=int, default=512)
    p.add_argument("--tv-weight", type=float, default=0.0)
    p.add_argument("--max-seq-len", "--max-len", dest="max_seq_len", type=int, default=2048,
                   help="rows are truncated to this many tokens")
    p.add_argument("--device", default=None, help="cuda, cpu (default: cuda if available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="target and drafter dtype (auto: bfloat16 on CUDA, float32 on CPU); Weaver trains in fp32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--val-frac", type=float, default=0.02)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=0, help="validate every N steps (0: only first and last)")
    p.add_argument("--time-budget-minutes", type=float, default=None,
                   help="fit --steps to this wall-clock budget (measured over the first steps)")
    p.add_argument("--init-from", type=Path, default=None,
                   help="continue training this saved Weaver (.pth; its shape wins over the shape flags)")
    p.add_argument("--no-feature-cache", action="store_true",
                   help="re-run the target every step instead of keeping its outputs for all rows in memory")
    p.add_argument("--save-dtype", default="float32", choices=["bfloat16", "float16", "float32"],
                   help="dtype of the saved tensors (training is fp32 regardless)")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    """``dflash-tfm train-weaver``: load the target and drafter, train, print the held-out metrics."""
    from dflash_tfm.errors import CheckpointError
    from dflash_tfm.loading.loader import load_target, parse_dtype
    from dflash_tfm.spec.dflash import load_dflash_drafter

    args = build_parser().parse_args(argv)
    try:
        missing = [str(p) for p in args.data if not p.is_file()]
        if missing:  # before the (slow) model loads
            raise FileNotFoundError(f"training data not found: {', '.join(missing)}")
        # Row lengths change every step; lazily compiling the layers' small fused helpers (layers/compile.py)
        # for each new shape of the frozen target and drafter would cost more than it saves.
        os.environ.setdefault("DFLASH_TFM_COMPILE", "0")
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = parse_dtype(args.dtype if args.dtype != "auto" else
                            ("bfloat16" if device.type == "cuda" else "float32"))
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True  # the fp32 Weaver's matmuls; accuracy is ample for training
        loaded = load_target(args.target_path, device, dtype)
        drafter = load_dflash_drafter(args.draft_model_path, loaded.model, loaded.config, device, dtype)
        result = train_weaver(
            loaded.model, drafter, args.data, args.out, d_rank=args.d_rank, num_heads=args.num_heads,
            mlp_dim=args.mlp_dim, num_layers=args.num_layers, variant=args.variant, pool_size=args.pool_size,
            steps=args.steps, batch_size=args.batch_size, lr=args.lr, schedule=args.schedule,
            tv_weight=args.tv_weight, device=device, seed=args.seed, val_frac=args.val_frac,
            log_every=args.log_every, eval_every=args.eval_every, positions_per_row=args.positions_per_row,
            time_budget_s=None if args.time_budget_minutes is None else 60 * args.time_budget_minutes,
            init_from=args.init_from, max_seq_len=args.max_seq_len,
            cache_features=False if args.no_feature_cache else None, progress=not args.no_progress,
            save_dtype=parse_dtype(args.save_dtype),
        )
    except (FileNotFoundError, CheckpointError, ValueError) as e:
        print(f"dflash-tfm train-weaver: error: {e}", file=sys.stderr)
        return 2
    b, a = result.val_before, result.val_after
    print(f"saved {result.out_path}\nheld-out KL {b['kl']:.4f} -> {a['kl']:.4f} (DFlash alone {a['dflash_kl']:.4f}); "
          f"top-1 agreement {b['top1']:.3f} -> {a['top1']:.3f} (DFlash alone {a['dflash_top1']:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
