"""The target decoder: embeddings -> N x (norm, mixer, norm, feed-forward) -> norm -> lm_head.

One class serves every supported architecture; each layer's mixer is softmax attention or Gated DeltaNet as
`config.layer_types` says, and its feed-forward a SwiGLU or, for the layers in `config.moe_layers`, a sparse
mixture of experts (per token, so a tree verify runs it on its nodes as on any rows). The model owns no cache:
callers pass a `ModelCache` (models/cache.py), which the engine allocates once so it can keep static buffers and
CUDA graphs.

At tensor-parallel size > 1 the model is one rank's slice (`parallel/sharding.py`): its layers are built from the
rank's config, so each mixer and feed-forward returns a partial sum of the row-parallel output projection, and
the one all-reduce per block that completes it sits here, where those outputs meet the residual stream.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from dflash_tfm.config import FULL_ATTENTION, ModelConfig
from dflash_tfm.kernels.attention.tree_attention import accepted_slots, write_accepted_kv
from dflash_tfm.layers.attention import Attention
from dflash_tfm.layers.fused_projections import add_norm_linear
from dflash_tfm.layers.gated_deltanet import GatedDeltaNet, GDNCommitStacks, commit_gdn_layers
from dflash_tfm.layers.linear import linear
from dflash_tfm.layers.mlp import SwiGLU, silu_and_mul
from dflash_tfm.layers.moe import SparseMoE
from dflash_tfm.layers.norm import RMSNorm
from dflash_tfm.layers.rotary import RotaryEmbedding
from dflash_tfm.layers.vocab_parallel import vocab_embedding, vocab_logits
from dflash_tfm.models.cache import ModelCache
from dflash_tfm.parallel.group import all_reduce
from dflash_tfm.parallel.sharding import Shard, shard_config, vocab_rows
from dflash_tfm.tree import TreeSpec


@dataclass
class VerifyContext:
    """What `CausalLM.commit` needs from a `verify` pass: each mixer's output by decoder layer index, and the
    layer-stacked GDN context the pass wrote in place (None when it kept per-node snapshots instead)."""

    layers: dict[int, object] = field(default_factory=dict)
    gdn_stacks: GDNCommitStacks | None = None


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.is_attention = cfg.layer_types[index] == FULL_ATTENTION
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_plus_one)
        self.mixer: Attention | GatedDeltaNet = Attention(cfg) if self.is_attention else GatedDeltaNet(cfg)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_plus_one)
        self.mlp: SwiGLU | SparseMoE = (
            SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                      cfg.shared_expert_intermediate_size, cfg.norm_topk_prob, cfg.local_experts)
            if index in cfg.moe_layers else SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        )

    def feed_forward(self, h: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, the feed-forward of post_norm(h + delta)). A SwiGLU takes the add + norm fused into its
        gate_up projection (`add_norm_linear`); a mixture of experts needs the normed rows themselves, which its
        router, shared expert and experts all read."""
        if isinstance(self.mlp, SparseMoE):
            h, x = self.post_norm.add_forward(h, delta)
            return h, all_reduce(self.mlp(x))
        h, gate_up = add_norm_linear(h, delta, self.post_norm, self.mlp.gate_up)
        return h, all_reduce(linear(silu_and_mul(gate_up), self.mlp.down))


class CausalLM(nn.Module):
    """Target model for inference. Parameters are created empty; `loading.load_weights` fills them. As one of
    several tensor-parallel ranks (`shard`) it holds that rank's slice and `config` is that rank's
    (`shard_config`)."""

    def __init__(self, cfg: ModelConfig, max_positions: int, shard: Shard = Shard()) -> None:
        super().__init__()
        cfg = self.config = shard_config(cfg, shard)
        rows = vocab_rows(cfg.vocab_size, shard.size)  # split by vocabulary rows where tp divides V
        self.embed_tokens = nn.Parameter(torch.empty(rows, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_plus_one)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Parameter(torch.empty(rows, cfg.hidden_size))
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rotary_dim, cfg.rope, max_positions, "target")

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: ModelCache,
        kv_len: int,
        tap_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run T new tokens through the model, advancing the caches.

        input_ids, positions [B, T]; kv_len bounds the attention keys read (static per CUDA graph).
        Returns the final-normed hidden states [B, T, hidden] and the outputs of `tap_layers` (decoder layer
        indices, as HF `hidden_states[i + 1]`) for the drafter.
        """
        def mixer(i: int, layer: DecoderLayer, proj: torch.Tensor) -> torch.Tensor:
            if layer.is_attention:
                k_cache, v_cache = cache.attention[i]
                return all_reduce(layer.mixer(proj, positions, self.rope, k_cache, v_cache, kv_len))
            state, window = cache.gdn[i]
            return all_reduce(layer.mixer(proj, state, window))

        return self._run_layers(self.embed(input_ids), mixer, tap_layers)

    def _run_layers(
        self, h: torch.Tensor, mixer: Callable[[int, "DecoderLayer", torch.Tensor], torch.Tensor],
        tap_layers: tuple[int, ...],
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The residual stream through every layer. Each residual add is fused into the following norm and the
        projection after it (`add_norm_linear`: the next mixer's input projection, the feed-forward's, or — the
        final norm — nothing), so h lags one block output behind; mixers receive their input projections."""
        taps: list[torch.Tensor] = []
        first = self.layers[0]
        proj = linear(first.input_norm(h), first.mixer.in_weight)
        for i, layer in enumerate(self.layers):
            h, mlp_out = layer.feed_forward(h, mixer(i, layer, proj))
            if i in tap_layers:
                taps.append(h + mlp_out)
            if i + 1 < len(self.layers):
                following = self.layers[i + 1]
                h, proj = add_norm_linear(h, mlp_out, following.input_norm, following.mixer.in_weight)
        return self.norm.add_forward(h, mlp_out)[1], taps

    def verify(
        self,
        tree: TreeSpec,
        cache: ModelCache,
        cache_len: int,
        tap_layers: tuple[int, ...] = (),
        gdn_kernel: str = "chunk",
    ) -> tuple[torch.Tensor, list[torch.Tensor], VerifyContext]:
        """One forward over all tree nodes (tree tensors [B, N]) hanging below the committed prefix of
        length `cache_len`. No cache is written. Returns final-normed hidden [B, N, hidden], the tap
        layers' outputs for every node, and per-layer data for `commit`."""
        stacks = cache.gdn_commit_stacks(tree.parents.shape[1]) if cache.gdn_layers and gdn_kernel == "chunk" else None
        saved = VerifyContext(gdn_stacks=stacks)

        def mixer(i: int, layer: DecoderLayer, proj: torch.Tensor) -> torch.Tensor:
            if layer.is_attention:
                k_cache, v_cache = cache.attention[i]
                out, saved.layers[i] = layer.mixer.verify(proj, tree.positions, self.rope, k_cache, v_cache, cache_len, tree.ancestors)
            else:
                state, window = cache.gdn[i]
                out, saved.layers[i] = layer.mixer.verify(proj, state, window, tree, gdn_kernel,
                                                   keep=None if stacks is None else stacks.layer(i))
            return all_reduce(out)

        hidden, taps = self._run_layers(self.embed(tree.tokens), mixer, tap_layers)
        return hidden, taps, saved

    def commit(
        self, cache: ModelCache, cache_len: int, tree: TreeSpec, saved: VerifyContext,
        accepted: torch.Tensor, path_indices: torch.Tensor,
    ) -> None:
        """Commit the accepted root->node path of the last `verify`: accepted [B, N] bool (root included),
        path_indices [B, M] the same nodes in order, -1 padded. Afterwards the caches hold the prefix plus
        the path at positions cache_len .. cache_len + a, as if the path had been decoded token by token."""
        if cache.attention_layers:  # one gather + one scatter per K and V for all attention layers
            slots = accepted_slots(cache_len, path_indices, tree.parents.shape[0], path_indices.device)
            k_tree = torch.stack([saved.layers[i][0] for i in cache.attention_layers])
            v_tree = torch.stack([saved.layers[i][1] for i in cache.attention_layers])
            write_accepted_kv(cache.k, cache.v, k_tree, v_tree, slots)
        if cache.gdn_layers:
            commit_gdn_layers(cache.states, cache.windows, [saved.layers[i] for i in cache.gdn_layers], tree.parents,
                              accepted, saved.gdn_stacks)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids -> input embeddings (vocab-parallel at tp > 1: `layers/vocab_parallel.py`)."""
        return vocab_embedding(ids, self.embed_tokens, self.config.vocab_size)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden [..., hidden] -> fp32 logits [..., V] (the full vocabulary on every rank)."""
        return vocab_logits(hidden, self.lm_head_weight, self.config.vocab_size)
