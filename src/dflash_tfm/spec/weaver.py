"""Weaver: the small autoregressive Transformer that re-scores DFlash candidates while a DFLASH_TFM tree grows.

Weaver reads a 16-row prefix (the target's last hidden state and the drafter's 15 lookahead hidden states),
then one row per tree node (the node's token); the normed output of a node, dotted with the precomputed
``W_res = lm_head.weight @ lm_head_query_in.weight``, is added to the DFlash logits of the next depth's
candidate pool. The checkpoint format and the three variants are in docs MODELS.md ("Weaver").

Where MODELS.md is silent we follow the public original implementation (the sglang-based ``Weaver`` /
``WeaverBlock`` classes of the DFlash-TfM system, found with the code search; read, not copied):

- blocks are pre-norm: ``x += o_proj(attn(norm_attn(x))); x += mlp(norm_mlp(x))``; no final norm inside a
  block, ``out_norm`` once after the last block;
- attention softmax in fp32; K/V stored after RoPE (variant 1); a node's own K/V is written before it attends;
- node positions use K where MODELS.md writes 15: RoPE at ``min(d, K) + 1``, ``pos_emb[min(d, K − 1)]`` (the
  original clamps to its block depth; identical for the released K = 15);
- checkpoints of variants 2/3 predate the ``activation`` and ``rope_base`` config keys (the old class took
  neither), so a missing ``activation`` is read off the MLP key names;
- ``W_res`` and ``token_table`` are kept in the Weaver dtype, the residual is accumulated in that dtype and
  added to the fp32 DFlash logits.

Static shapes everywhere (no host sync in :meth:`Weaver.encode_prefix` / :meth:`Weaver.step`), so tree
building can be captured in a CUDA graph.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from dflash_tfm.config import ModelConfig
from dflash_tfm.kernels.tree_growth.reference import pool_logits_plus_residual, weaver_norm
from dflash_tfm.layers.compile import fuse_on_cuda
from dflash_tfm.layers.vocab_parallel import gather_vocab_rows
from dflash_tfm.errors import CheckpointError, CheckpointNotFoundError

ACTIVATIONS = ("swiglu", "gelu")
ENCODER_MODES = {3: 3, "global_prompt": 3}  # only the "global prompt" encoder exists in released files
SCORE_HEADS = {4: 4, "simple_score": 4}
SPECULATOR_KIND = "dflash_tfm_weaver"
NORM_EPS = 1e-6
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WeaverConfig:
    """The checkpoint's ``config`` dict. ``activation`` "swiglu" = variant 1 (rotary), "gelu" = variants 2/3
    (learned ``pos_emb``)."""

    d_model: int
    d_embed: int
    d_rank: int
    num_layers: int
    num_heads: int
    mlp_dim: int
    K: int
    candidate_pool_size: int
    activation: str = "swiglu"
    rope_base: float = 10000.0
    encoder_mode: int = 3
    score_head: int = 4

    @property
    def head_dim(self) -> int:
        return self.d_rank // self.num_heads

    @property
    def rotary(self) -> bool:
        return self.activation == "swiglu"

    @property
    def prefix_len(self) -> int:
        return self.K + 1

    @classmethod
    def from_dict(cls, raw: Mapping, activation_from_keys: str | None = None) -> WeaverConfig:
        """Validate a checkpoint config; ``activation_from_keys`` is what the state_dict's MLP names say."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise CheckpointError(f"Weaver config has unknown keys {unknown}; expected a subset of {sorted(known)}")
        ints = ("d_model", "d_embed", "d_rank", "num_layers", "num_heads", "mlp_dim", "K", "candidate_pool_size")
        missing = [k for k in ints if k not in raw]
        if missing:
            raise CheckpointError(f"Weaver config is missing {missing}")
        for k in ints:
            if isinstance(raw[k], bool) or not isinstance(raw[k], int) or raw[k] < 1:
                raise CheckpointError(f"Weaver config {k} must be a positive integer, got {raw[k]!r}")
        activation = raw.get("activation", activation_from_keys)
        if activation not in ACTIVATIONS:
            raise CheckpointError(f"unknown Weaver activation {activation!r}; supported: {', '.join(ACTIVATIONS)}")
        if activation_from_keys is not None and activation != activation_from_keys:
            raise CheckpointError(f"Weaver config says activation {activation!r} but the state_dict has "
                                  f"{activation_from_keys} MLP weights (mixed variant)")
        encoder, head = raw.get("encoder_mode", 3), raw.get("score_head", 4)
        if encoder not in ENCODER_MODES or head not in SCORE_HEADS:
            raise CheckpointError(f"unsupported Weaver encoder_mode={encoder!r} / score_head={head!r}; "
                                  "only 3 (global_prompt) / 4 (simple_score) exist")
        rope_base = raw.get("rope_base", 10000.0)
        if isinstance(rope_base, bool) or not isinstance(rope_base, (int, float)):
            raise CheckpointError(f"Weaver config rope_base must be a number, got {rope_base!r}")
        cfg = cls(**{k: raw[k] for k in ints}, activation=activation, rope_base=float(rope_base),
                  encoder_mode=ENCODER_MODES[encoder], score_head=SCORE_HEADS[head])
        if cfg.d_rank % cfg.num_heads or (cfg.rotary and cfg.head_dim % 2) or cfg.rope_base <= 0:
            raise CheckpointError(f"Weaver d_rank {cfg.d_rank} must split into {cfg.num_heads} heads "
                                  "(of even size for RoPE) and rope_base must be positive")
        return cfg


@dataclass
class WeaverCache:
    """Per-layer keys/values of the prefix rows followed by one slot per tree node.

    ``k``, ``v`` are ``[L, P + N, heads, head_dim]`` (P = K + 1 prefix rows); node slot j lives at row P + j.
    Zero-initialised so that masked, not-yet-written slots can never inject NaNs into the attention.
    """

    k: torch.Tensor
    v: torch.Tensor
    prefix_len: int


class WeaverNorm(nn.Module):
    """RMSNorm with weight AND bias, statistics and affine in fp32, no mean subtraction."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.bias = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return weaver_norm(x, self.weight, self.bias, NORM_EPS)


class WeaverBlock(nn.Module):
    """Pre-norm block: attention (fused qkv, no bias) then SwiGLU (variant 1) or erf-GELU MLP (variants 2/3)."""

    def __init__(self, cfg: WeaverConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.swiglu = cfg.activation == "swiglu"
        self.norm_attn = WeaverNorm(cfg.d_rank)
        self.qkv_proj = nn.Linear(cfg.d_rank, 3 * cfg.d_rank, bias=False)
        self.o_proj = nn.Linear(cfg.d_rank, cfg.d_rank, bias=False)
        self.norm_mlp = WeaverNorm(cfg.d_rank)
        if self.swiglu:
            self.gate_up_proj = nn.Linear(cfg.d_rank, 2 * cfg.mlp_dim)
            self.down_proj = nn.Linear(cfg.mlp_dim, cfg.d_rank)
        else:
            self.fc1 = nn.Linear(cfg.d_rank, cfg.mlp_dim)
            self.fc2 = nn.Linear(cfg.mlp_dim, cfg.d_rank)

    def project_qkv(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, d_rank] -> q, k, v [T, heads, head_dim]; ``rope`` = (cos, sin) [T, head_dim] fp32 or None."""
        q, k, v = self.qkv_proj(self.norm_attn(x)).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        if rope is not None:
            q, k = _rotate(q, *rope), _rotate(k, *rope)
        return q, k, v

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual attention output (attn [T, d_rank]), then the residual MLP."""
        x = x + self.o_proj(attn)
        h = self.norm_mlp(x)
        if self.swiglu:
            gate, up = self.gate_up_proj(h).chunk(2, dim=-1)
            return x + self.down_proj(F.silu(gate) * up)
        return x + self.fc2(F.gelu(self.fc1(h)))


def _fill_prefix(h_dflash: torch.Tensor, h_target: torch.Tensor, weaver: Weaver, cache: WeaverCache) -> None:
    """The prefix rows of :meth:`Weaver.encode_prefix`, their K/V written into ``cache`` rows 0 … P − 1."""
    cfg, P = weaver.config, cache.prefix_len
    feats = torch.cat([h_target.reshape(1, -1), h_dflash], 0).to(cache.k.dtype)
    x = weaver.proposal_in(weaver.output_norm(feats))  # [P, d_rank]
    if not cfg.rotary:
        x = torch.cat([x[:1], x[1:] + weaver.pos_emb], 0)
    causal = torch.ones(P, P, dtype=torch.bool, device=x.device).tril()
    rope = weaver._rope(slice(0, P))
    for layer, block in enumerate(weaver.blocks):
        q, k, v = block.project_qkv(x, rope)
        cache.k[layer, :P], cache.v[layer, :P] = k, v
        x = block.finish(x, _attend(q, k, v, causal))


# Once per tree on CUDA, one compiled function: the prefix's three norms, RoPE and softmax are otherwise ~40
# launches of a few µs each (docs/PERFORMANCE.md, speculative step parts). Sized by its K + 1 rows.
fill_prefix = fuse_on_cuda(_fill_prefix, count_rows=True)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE over the full head dim, in fp32: x [T, heads, hd], cos/sin [T, hd]."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [W, H, D] over k, v [T, H, D] where mask [W, T] (bool, True = visible); fp32 softmax -> [W, H·D]."""
    scores = torch.einsum("whd,thd->hwt", q.float(), k.float()) * q.shape[-1] ** -0.5
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1).to(v.dtype)
    return torch.einsum("hwt,thd->whd", probs, v).reshape(q.shape[0], -1)


class Weaver(nn.Module):
    """Weaver weights (state_dict names as in the checkpoint, variant 3 stored fused) plus the per-target tables
    filled by :meth:`prepare`: ``token_table [V, d_rank]``, ``w_res [V, d_rank]`` and the RoPE tables."""

    token_table: torch.Tensor
    w_res: torch.Tensor
    rope_cos: torch.Tensor | None
    rope_sin: torch.Tensor | None

    def __init__(self, cfg: WeaverConfig) -> None:
        super().__init__()
        self.config = cfg
        self.output_norm = WeaverNorm(cfg.d_model)
        self.embed_norm = WeaverNorm(cfg.d_embed)
        self.token_in = nn.Linear(cfg.d_embed, cfg.d_rank)
        self.proposal_in = nn.Linear(cfg.d_model, cfg.d_rank)
        self.blocks = nn.ModuleList(WeaverBlock(cfg) for _ in range(cfg.num_layers))
        self.out_norm = WeaverNorm(cfg.d_rank)
        self.lm_head_query_in = nn.Linear(cfg.d_rank, cfg.d_model, bias=False)
        if not cfg.rotary:
            self.pos_emb = nn.Parameter(torch.empty(cfg.K, cfg.d_rank))
        for name in ("token_table", "w_res", "rope_cos", "rope_sin"):
            self.register_buffer(name, None, persistent=False)

    @torch.no_grad()
    def prepare(self, embed_tokens: torch.Tensor, lm_head_weight: torch.Tensor, chunk_rows: int = 16384,
                vocab_size: int | None = None) -> None:
        """Precompute the per-target tables once at load, ``chunk_rows`` vocabulary rows at a time (fp32
        intermediates stay at chunk size): ``token_table = token_in(embed_norm(E))``,
        ``w_res = lm_head.weight @ lm_head_query_in.weight``; both ``[V, d_rank]`` in the Weaver dtype. With a
        vocab-parallel target (tables of fewer rows than ``vocab_size``) each rank computes its rows and the
        full tables are gathered, since trees read them at any candidate id."""
        cfg, p = self.config, self.lm_head_query_in.weight
        if embed_tokens.shape[1] != cfg.d_embed or lm_head_weight.shape[1] != cfg.d_model:
            raise CheckpointError(f"target embedding {tuple(embed_tokens.shape)} / lm_head {tuple(lm_head_weight.shape)}"
                                  f" do not fit Weaver d_embed {cfg.d_embed} / d_model {cfg.d_model}")
        vocab = embed_tokens.shape[0]
        self.token_table = torch.empty(vocab, cfg.d_rank, dtype=p.dtype, device=p.device)
        self.w_res = torch.empty(lm_head_weight.shape[0], cfg.d_rank, dtype=p.dtype, device=p.device)
        for s in range(0, vocab, chunk_rows):
            rows = embed_tokens[s : s + chunk_rows].to(device=p.device, dtype=p.dtype)
            self.token_table[s : s + chunk_rows] = self.token_in(self.embed_norm(rows))
        for s in range(0, lm_head_weight.shape[0], chunk_rows):
            rows = lm_head_weight[s : s + chunk_rows].to(device=p.device, dtype=torch.float32)
            self.w_res[s : s + chunk_rows] = rows @ p.float()
        vocab_size = vocab_size or vocab
        self.token_table = gather_vocab_rows(self.token_table, vocab_size)
        self.w_res = gather_vocab_rows(self.w_res, vocab_size)
        if cfg.rotary:  # prefix rows at 0…K, nodes at min(depth, K) + 1 ≤ K + 1
            inv_freq = cfg.rope_base ** (-torch.arange(0, cfg.head_dim, 2, device=p.device).float() / cfg.head_dim)
            angles = torch.outer(torch.arange(cfg.K + 2, device=p.device).float(), inv_freq).repeat(1, 2)
            self.rope_cos, self.rope_sin = angles.cos(), angles.sin()

    def limit_depth(self, depth: int) -> None:
        """Grow trees only `depth` < K levels deep (a drafter block shorter than the Weaver's K + 1): the prefix
        then holds the target's row and `depth` drafter rows, and variants 2/3 keep the first `depth` position
        embeddings. Call before `prepare` (it sizes the RoPE tables by K)."""
        self.config = replace(self.config, K=depth)
        if not self.config.rotary:
            self.pos_emb = nn.Parameter(self.pos_emb[:depth].clone(), requires_grad=False)

    def _rope(self, positions: torch.Tensor | slice) -> tuple[torch.Tensor, torch.Tensor] | None:
        return (self.rope_cos[positions], self.rope_sin[positions]) if self.config.rotary else None

    def encode_prefix(self, h_target: torch.Tensor, h_dflash: torch.Tensor, num_nodes: int = 0) -> WeaverCache:
        """Run the P = K + 1 prefix rows causally and keep their per-layer K/V, with room for ``num_nodes`` nodes.

        h_target [d_model]: the target's final-normed hidden state at the last committed token (row 0);
        h_dflash [K, d_model]: the drafter's final-normed hidden states for depths 1…K (rows 1…K, + pos_emb).
        """
        cfg, dtype = self.config, self.token_in.weight.dtype
        shape = (cfg.num_layers, cfg.prefix_len + num_nodes, cfg.num_heads, cfg.head_dim)
        cache = WeaverCache(h_dflash.new_zeros(shape, dtype=dtype), h_dflash.new_zeros(shape, dtype=dtype),
                            cfg.prefix_len)
        fill_prefix(h_dflash, h_target, self, cache)
        return cache

    def step(
        self, cache: WeaverCache, slots: torch.Tensor, tokens: torch.Tensor, depths: torch.Tensor,
        ancestors: torch.Tensor,
    ) -> torch.Tensor:
        """Advance W tree nodes in one batched call and return ``out_norm(x)`` ``[W, d_rank]`` (see
        :meth:`step_rows`)."""
        return self.out_norm(self.step_rows(cache, slots, tokens, depths, ancestors))

    def step_rows(
        self, cache: WeaverCache, slots: torch.Tensor, tokens: torch.Tensor, depths: torch.Tensor,
        ancestors: torch.Tensor,
    ) -> torch.Tensor:
        """The last block's output ``x [W, d_rank]`` of W tree nodes advanced in one batched call (the twin of
        ``kernels.tree_growth.weaver_step``).

        slots [W] long: node slots (0…N−1) whose K/V this call writes into ``cache``; tokens, depths [W] long;
        ancestors [W, N] bool: the inclusive ancestor set of each node by slot (root and itself included).
        Every ancestor must have been written by an earlier call or by this one (a row's layer-l K/V depends
        only on layers < l of its ancestors, so parent and child may even share a call).
        """
        cfg = self.config
        x = self.token_table[tokens]
        if not cfg.rotary:
            x = x + self.pos_emb[depths.clamp(max=cfg.K - 1)]
        rope = self._rope(depths.clamp(max=cfg.K) + 1)
        prefix = torch.ones(tokens.shape[0], cache.prefix_len, dtype=torch.bool, device=x.device)
        mask = torch.cat([prefix, ancestors], 1)
        rows = slots + cache.prefix_len
        for layer, block in enumerate(self.blocks):
            q, k, v = block.project_qkv(x, rope)
            cache.k[layer].index_copy_(0, rows, k)
            cache.v[layer].index_copy_(0, rows, v)
            x = block.finish(x, _attend(q, cache.k[layer], cache.v[layer], mask))
        return x

    def child_logits(self, query: torch.Tensor, pool_ids: torch.Tensor, pool_logits: torch.Tensor) -> torch.Tensor:
        """Re-scored candidate logits ``dflash_logit_c + W_res[c] · query`` fp32 ``[W, pool]``.

        query [W, d_rank] (output of :meth:`step`), pool_ids [W, pool] long, pool_logits [W, pool] fp32.
        Weaver never projects onto the full vocabulary: only the pool rows of ``w_res`` are read.
        """
        return pool_logits_plus_residual(self.w_res, query, pool_ids, pool_logits)


class TargetTables(Protocol):
    """What Weaver reads from its target: a ``CausalLM``, or a light stand-in holding just these tensors."""

    @property
    def embed_tokens(self) -> torch.Tensor: ...  # [V, d_embed]

    @property
    def lm_head_weight(self) -> torch.Tensor: ...  # [V, hidden]


def load_weaver(
    path: str | Path, target_model: TargetTables, target_cfg: ModelConfig, block_size: int,
    device: torch.device | str, dtype: torch.dtype,
) -> Weaver:
    """Load a Weaver ``torch.save`` checkpoint strictly and precompute its tables for ``target_model``.

    ``target_cfg`` is the target's config (only ``hidden_size`` is read). Any missing or extra tensor or config
    key, wrong shape, or config that does not fit the target raises :class:`CheckpointError`. As the published
    system does, trees grow min(block_size − 1, K) levels deep (`Weaver.limit_depth` when the drafter's block is
    the shorter), and top-level keys besides ``config`` / ``state_dict`` / ``metadata`` are ignored (logged).
    """
    path = Path(path).expanduser()
    payload = _read_payload(path)
    state = dict(payload["state_dict"])
    cfg = WeaverConfig.from_dict(payload["config"], _activation_from_keys(state))
    embed_dim = target_model.embed_tokens.shape[1]
    if cfg.d_model != target_cfg.hidden_size:
        raise CheckpointError(f"Weaver d_model {cfg.d_model} does not match the target hidden size {target_cfg.hidden_size}")
    if cfg.d_embed != embed_dim:
        raise CheckpointError(f"Weaver d_embed {cfg.d_embed} does not match the target embedding dim {embed_dim}")
    state = _fuse_split_qkv(state, cfg)
    with torch.device("meta"):
        model = Weaver(cfg)
    _check_state_dict(state, model, path)
    model = model.to_empty(device=device).to(dtype)
    model.load_state_dict(state)
    model.eval().requires_grad_(False)
    if block_size - 1 < cfg.K:
        model.limit_depth(block_size - 1)
    model.prepare(target_model.embed_tokens, target_model.lm_head_weight, vocab_size=target_cfg.vocab_size)
    return model


def _read_payload(path: Path) -> dict:
    """``torch.load(weights_only=True)`` plus a structure check of ``{"config", "state_dict", "metadata"?, ...}``
    (other top-level keys, e.g. a training step or optimizer state the published system's files may carry, are
    ignored as it ignores them)."""
    if not path.is_file():
        raise CheckpointNotFoundError(f"Weaver checkpoint not found: {path}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle, zip and weights_only errors all mean "not a usable checkpoint"
        raise CheckpointError(f"cannot read Weaver checkpoint {path}: {e}") from None
    if not isinstance(payload, dict) or not {"config", "state_dict"} <= set(payload):
        raise CheckpointError(f"{path} is not a Weaver checkpoint: expected a dict with 'config' and 'state_dict'")
    extra = sorted(map(str, set(payload) - {"config", "state_dict", "metadata"}))
    if extra:
        logger.info("%s: ignoring top-level keys %s (not part of a Weaver)", path, extra)
    if not isinstance(payload["config"], Mapping) or not isinstance(payload["state_dict"], Mapping):
        raise CheckpointError(f"{path}: 'config' and 'state_dict' must both be dicts")
    bad = [k for k, v in payload["state_dict"].items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointError(f"{path}: state_dict entries must map names to tensors (bad: {bad[:5]})")
    metadata = payload.get("metadata") or {}
    kind = metadata.get("speculator_kind", SPECULATOR_KIND) if isinstance(metadata, Mapping) else metadata
    if kind != SPECULATOR_KIND:
        raise CheckpointError(f"{path}: metadata speculator_kind is {kind!r}, expected {SPECULATOR_KIND!r}")
    return payload


def _activation_from_keys(state: Mapping[str, torch.Tensor]) -> str | None:
    """'swiglu' if the MLPs are gate_up_proj/down_proj, 'gelu' if fc1/fc2, None if neither; both is an error."""
    swiglu = any(".gate_up_proj." in k or ".down_proj." in k for k in state)
    gelu = any(".fc1." in k or ".fc2." in k for k in state)
    if swiglu and gelu:
        raise CheckpointError("Weaver state_dict mixes variant keys: both gate_up_proj/down_proj and fc1/fc2 MLPs")
    return "swiglu" if swiglu else "gelu" if gelu else None


def _fuse_split_qkv(state: dict[str, torch.Tensor], cfg: WeaverConfig) -> dict[str, torch.Tensor]:
    """Variant 3: replace ``blocks.{i}.{q,k,v}_proj.weight`` by the fused ``qkv_proj.weight`` rows q | k | v."""
    for i in range(cfg.num_layers):
        names = [f"blocks.{i}.{p}_proj.weight" for p in "qkv"]
        present = [n for n in names if n in state]
        if not present:
            continue
        fused = f"blocks.{i}.qkv_proj.weight"
        if fused in state:
            raise CheckpointError(f"Weaver state_dict mixes variant keys: {fused!r} and {present[0]!r}")
        for n in names:
            if n not in state:
                raise CheckpointError(f"missing Weaver tensor {n!r} (split q/k/v projections need all three)")
            if tuple(state[n].shape) != (cfg.d_rank, cfg.d_rank):
                raise CheckpointError(f"Weaver tensor {n!r}: expected shape {[cfg.d_rank, cfg.d_rank]}, "
                                      f"found {list(state[n].shape)}")
        state[fused] = torch.cat([state.pop(n) for n in names], 0)
    return state


def _check_state_dict(state: Mapping[str, torch.Tensor], model: Weaver, path: Path) -> None:
    """Every missing, unexpected or wrongly shaped tensor, named with both shapes, in one CheckpointError."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    problems = [f"missing tensor {k!r} (expected shape {list(s)})" for k, s in expected.items() if k not in state]
    for k, t in state.items():
        if k not in expected:
            problems.append(f"unexpected tensor {k!r} (shape {list(t.shape)})")
        elif tuple(t.shape) != expected[k]:
            problems.append(f"tensor {k!r}: expected shape {list(expected[k])}, found {list(t.shape)}")
        elif not t.is_floating_point():
            problems.append(f"tensor {k!r} has non-float dtype {t.dtype}")
    if problems:
        shown = "\n  ".join(problems[:20]) + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
        variant = "1 (swiglu, rotary)" if model.config.rotary else "2/3 (gelu, pos_emb)"
        raise CheckpointError(f"Weaver checkpoint {path} does not fit variant {variant}:\n  {shown}")

