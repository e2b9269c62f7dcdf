"""How a target is split across tensor-parallel ranks: which heads and widths each rank holds, and which rows or
columns of each checkpoint tensor it reads.

Megatron's scheme. Column-parallel (rows of the weight split): attention q/k/v by heads, the GDN's fused input
projection and conv by key/value heads, the MLP's and every expert's gate/up by intermediate width. Row-parallel
(columns split): o_proj, the GDN's out_proj, down projections; their partial outputs are summed by one
all-reduce per mixer and per feed-forward (`models/decoder.py`). Everything a head owns stays on its rank: the
attention K/V cache of its KV heads, the GDN state and conv window of its value heads, so the tree verify and
commit need no communication. KV heads fewer than ranks are replicated (each rank keeps the one its query heads
read). Experts are split inside (each rank a slice of every expert's width), or with expert parallelism
(`Shard.experts`, `--ep-size`) each rank holds E / N whole experts and computes only the assignments routed to
them; either way routing is the same everywhere and the routed and shared experts' sum takes the same single
all-reduce (the shared expert is always split by width). Whole experts keep each expert's GEMMs as wide as at
tp 1 (at tp 8 a 512-wide expert would be 64 wide, and an FP8 one could not be split on its 128-column scale
blocks at all); a step then waits for the rank its tokens routed to most. The embedding and lm_head are split by
vocabulary rows when the rank count divides the vocabulary (`vocab_rows`; `layers/vocab_parallel.py`: a lookup
masked to the rank's rows and all-reduced, logits all-gathered, so every rank holds the full logits and samples
the same tokens), else replicated. The router and norms are replicated; so are the drafter and Weaver, which use
the target's embedding and lm_head through the same vocab-parallel functions.

The split is a config: `shard_config` returns the rank's `ModelConfig` (head counts and widths divided), from
which the model and its caches are built unchanged; `Shard.part` says what to read of a checkpoint tensor.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from dflash_tfm.config import ModelConfig

# A checkpoint tensor's slice a rank reads: (dim, ((start, length), ...)), the ranges concatenated along dim.
Part = tuple[int, tuple[tuple[int, int], ...]]


def take_part(tensor: torch.Tensor, part: Part | None) -> torch.Tensor:
    """The slice `part` of a whole tensor (its ranges along its dim, concatenated); the tensor itself for None."""
    if part is None:
        return tensor
    dim, ranges = part
    return torch.cat([tensor.narrow(dim, start, n) for start, n in ranges], dim=dim)


def _divides(tp: int, count: int, field: str) -> None:
    if count % tp:
        raise ValueError(f"--tp-size {tp} does not divide the target's {field} ({count})")


def check_ep_size(tp: int, ep: int) -> None:
    """Expert parallelism spreads the experts over the tensor-parallel ranks: --ep-size is 1 or --tp-size."""
    if ep not in (1, tp):
        raise ValueError(f"--ep-size must be 1 or equal to --tp-size ({tp}): expert parallelism spreads the experts "
                         f"over the tensor-parallel ranks; got {ep}")


def check_tp_size(cfg: ModelConfig, tp: int, expert_parallel: bool = False) -> None:
    """Refuse a tensor-parallel size the target's heads, widths or (with `expert_parallel`) experts do not split
    into, naming the config field."""
    if tp < 1:
        raise ValueError(f"--tp-size must be at least 1, got {tp}")
    if tp == 1:
        return
    if any(t == "full_attention" for t in cfg.layer_types):
        _divides(tp, cfg.num_heads, "num_attention_heads")
        if cfg.num_kv_heads >= tp:
            _divides(tp, cfg.num_kv_heads, "num_key_value_heads")
        elif tp % cfg.num_kv_heads:
            raise ValueError(f"--tp-size {tp} is not a multiple of the target's num_key_value_heads "
                             f"({cfg.num_kv_heads}), so its KV heads cannot be replicated evenly")
    if cfg.is_hybrid:
        _divides(tp, cfg.linear_num_key_heads, "linear_num_key_heads")
        _divides(tp, cfg.linear_num_value_heads, "linear_num_value_heads")
    if len(cfg.moe_layers) < cfg.num_layers:
        _divides(tp, cfg.intermediate_size, "intermediate_size")
    if cfg.moe_layers:
        if expert_parallel:
            _divides(tp, cfg.num_experts, "num_experts")
        else:
            _divides(tp, cfg.moe_intermediate_size, "moe_intermediate_size")
        _divides(tp, cfg.shared_expert_intermediate_size, "shared_expert_intermediate_size")


def shard_config(cfg: ModelConfig, shard: Shard) -> ModelConfig:
    """The config of one rank's slice of the target (`check_tp_size` first): what its layers and caches hold."""
    tp = shard.size
    check_tp_size(cfg, tp, shard.experts)
    if tp == 1:
        return cfg
    experts = shard.experts and bool(cfg.moe_layers)
    return replace(
        cfg, num_heads=cfg.num_heads // tp, num_kv_heads=max(1, cfg.num_kv_heads // tp),
        intermediate_size=cfg.intermediate_size // tp,
        linear_num_key_heads=cfg.linear_num_key_heads // tp, linear_num_value_heads=cfg.linear_num_value_heads // tp,
        moe_intermediate_size=cfg.moe_intermediate_size if experts else cfg.moe_intermediate_size // tp,
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // tp,
        local_experts=shard.block(cfg.num_experts) if experts else None,
    )


def vocab_rows(vocab_size: int, tp: int) -> int:
    """Rows of the embedding and of the lm_head one rank holds: V / tp when tp divides V, else all V."""
    return vocab_size // tp if tp > 1 and vocab_size % tp == 0 else vocab_size


@dataclass(frozen=True)
class Shard:
    """This process's rank among `size` tensor-parallel ranks; at size 1 every `part` is None (read it whole).
    experts: expert parallelism, each rank holding `block(num_experts)` whole routed experts (module docstring)."""

    rank: int = 0
    size: int = 1
    experts: bool = False

    def block(self, count: int, width: int = 1, offset: int = 0) -> tuple[int, int]:
        """(start, length) of this rank's share of `count` units of `width` rows starting at row `offset`."""
        n = count // self.size
        return offset + self.rank * n * width, n * width

    def kv_block(self, num_kv_heads: int, head_dim: int, offset: int = 0) -> tuple[int, int]:
        """(start, length) of the KV heads this rank keeps: its share, or the one head its query heads read when
        there are fewer KV heads than ranks."""
        if num_kv_heads >= self.size:
            return self.block(num_kv_heads, head_dim, offset)
        return offset + self.rank * num_kv_heads // self.size * head_dim, head_dim

    def part(self, dim: int, *ranges: tuple[int, int]) -> Part | None:
        """The slice of a checkpoint tensor to read (None at tp 1)."""
        return None if self.size == 1 else (dim, ranges)
