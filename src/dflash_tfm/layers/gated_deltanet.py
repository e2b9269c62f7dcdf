"""Gated DeltaNet mixer (Qwen3.5 / Qwen3-Next linear-attention layers) with a recurrent state cache.

The four input projections are fused into one `in_proj` matrix laid out [q | k | v | z | b | a] (loader's
job), so the decode step does one GEMV. The recurrence per value head j (key head j // (HV/HK)):
S <- e^g S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q  (q, k L2-normalised, q scaled dk^-0.5).
Everything between the GEMVs and the recurrence (split, short conv, SiLU, l2norm, beta, g) is one
pure function, `kernels.gdn.reference.gdn_inputs`, fused by inductor on CUDA.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dflash_tfm.config import ModelConfig
from dflash_tfm.kernels.conv.tree_conv import tree_conv_commit
from dflash_tfm.kernels.gdn import reference
from dflash_tfm.kernels.gdn.fused_decode import gdn_fused_decode
from dflash_tfm.kernels.gdn.prefill import gdn_prefill
from dflash_tfm.kernels.gdn.tree_commit import gdn_tree_commit
from dflash_tfm.kernels.gdn.tree_inputs import gdn_tree_inputs
from dflash_tfm.kernels.gdn.tree_reference import GDNTreeContext
from dflash_tfm.kernels.gdn.tree_verify import gdn_tree_verify
from dflash_tfm.layers.compile import fuse_on_cuda
from dflash_tfm.layers.linear import linear, projection_weight
from dflash_tfm.layers.norm import gated_rms_norm
from dflash_tfm.tree import TreeSpec

# The decode and prefill inputs as one compiled function on CUDA.
gdn_inputs = fuse_on_cuda(reference.gdn_inputs)


@dataclass(frozen=True)
class GDNCommitStacks:
    """Every GDN layer's commit context of one verify pass over N tree nodes, layer-stacked: the conv inputs
    `mixed [Lg, B, N, C]`, the solved rows `u [Lg, B, N, HV, dv]` fp32 and path log-decays `G [Lg, B, N, HV]`
    fp32. Each layer's verify writes its slice in place (the kernels store there instead of into new tensors),
    so the commit shifts every conv window and folds every state in one launch each, without the copies that
    stacking per-layer outputs would take (~0.1 ms at Qwen3.6-27B scale). `slot` maps decoder layer index to
    stack position."""

    mixed: torch.Tensor
    u: torch.Tensor
    G: torch.Tensor
    slot: dict[int, int]

    @classmethod
    def allocate(cls, cfg: ModelConfig, layers: list[int], batch: int, nodes: int, dtype: torch.dtype,
                 device: torch.device) -> "GDNCommitStacks":
        L, hv, f32 = len(layers), cfg.linear_num_value_heads, torch.float32
        return cls(mixed=torch.empty(L, batch, nodes, cfg.gdn_conv_dim, dtype=dtype, device=device),
                   u=torch.empty(L, batch, nodes, hv, cfg.linear_value_head_dim, dtype=f32, device=device),
                   G=torch.empty(L, batch, nodes, hv, dtype=f32, device=device),
                   slot={layer: j for j, layer in enumerate(layers)})

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Decoder layer i's slices (mixed, u, G)."""
        j = self.slot[i]
        return self.mixed[j], self.u[j], self.G[j]


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.value_dim, self.conv_dim = cfg.gdn_value_dim, cfg.gdn_conv_dim
        self.eps = cfg.rms_norm_eps
        self.in_proj = projection_weight(self.conv_dim + self.value_dim + 2 * self.hv, cfg.hidden_size)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, cfg.linear_conv_kernel_dim))
        self.A_log = nn.Parameter(torch.empty(self.hv))
        self.dt_bias = nn.Parameter(torch.empty(self.hv))
        self.norm_weight = nn.Parameter(torch.empty(self.dv))
        self.out_proj = projection_weight(cfg.hidden_size, self.value_dim)

    def output_norm(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """o, z [B, T, HV, dv] -> out_proj's input [B, T, HV·dv] (the gated norm)."""
        y = gated_rms_norm(o, z, self.norm_weight, self.eps)
        return y.reshape(*y.shape[:2], self.value_dim)

    @property
    def in_weight(self) -> torch.Tensor:
        """The input projection: the decoder applies it (fused with the norm before it at decode)."""
        return self.in_proj

    def forward(self, proj: torch.Tensor, state: torch.Tensor, conv_window: torch.Tensor) -> torch.Tensor:
        """Advance the layer over T tokens, given their projections proj [B, T, q|k|v|z|b|a] (normed input times
        `in_weight`); state [B, HV, dk, dv] fp32 and conv_window [B, conv_dim, K-1] are updated in place.
        T == 1 runs one fused kernel from the projection to the gated norm (CUDA-graph safe); prefill runs the
        chunked kernel."""
        if proj.shape[1] == 1:
            y = gdn_fused_decode(
                proj, self.conv_weight, conv_window, self.A_log, self.dt_bias,
                self.norm_weight, state, hk=self.hk, dk=self.dk, hv=self.hv, dv=self.dv, eps=self.eps)
            return linear(y, self.out_proj)
        q, k, v, z, beta, g, new_window = gdn_inputs(
            proj, self.conv_weight, conv_window, self.A_log, self.dt_bias,
            self.hk, self.dk, self.hv, self.dv)
        conv_window.copy_(new_window)
        o, final_state = gdn_prefill(q, k, v, g, beta, state)
        state.copy_(final_state)
        return linear(self.output_norm(o, z), self.out_proj)

    def verify(
        self,
        proj: torch.Tensor,
        state: torch.Tensor,
        conv_window: torch.Tensor,
        tree: TreeSpec,
        kernel: str = "chunk",
        keep: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, GDNTreeContext]]:
        """Outputs of all tree nodes (their projections proj [B, N, *]; the step's tree, [B, N] tensors)
        from the committed state and conv window, which are only read. Returns what `commit` needs; `keep`
        (this layer's `GDNCommitStacks.layer` slices, chunk kernel) receives it in place."""
        keep_mixed, u_out, G_out = (None, None, None) if keep is None else keep
        # From in_proj's output to the solve's: the verify inputs (tree conv, SiLU, q/k norm, β, g) in one launch,
        # then the tree solve. One launch beat the three separate kernels at every tree size in every H200 run
        # (N = 65: 9.4–9.5 against 13.2–14.4 µs per layer; docs/data/perf/verify_step_h200_2026-12-0[34]*.json).
        q, k, v, z, beta, g = gdn_tree_inputs(
            proj, self.conv_weight, self.A_log, self.dt_bias, tree.parents, conv_window, self.hk, self.dk, self.hv,
            self.dv, keep_input=keep_mixed, nearest=tree.nearest_ancestors)
        o, ctx = gdn_tree_verify(q, k, v, g, beta, tree.parents, state, kernel=kernel, ancestors=tree.ancestors,
                                 u_out=u_out, G_out=G_out)
        y = self.output_norm(o, z)
        return linear(y, self.out_proj), (proj[..., : self.conv_dim] if keep_mixed is None else keep_mixed, ctx)

    @staticmethod
    def commit(
        state: torch.Tensor, conv_window: torch.Tensor, saved: tuple[torch.Tensor, GDNTreeContext],
        parents: torch.Tensor, accepted: torch.Tensor,
    ) -> None:
        """Advance state and conv window along the accepted path only (accepted [B, N] bool, root included)."""
        mixed, ctx = saved
        tree_conv_commit(mixed, parents, accepted, conv_window, out=conv_window)  # both in place: no copies
        gdn_tree_commit(ctx, accepted, out=state)


def commit_gdn_layers(
    states: torch.Tensor, windows: torch.Tensor, saved: list[tuple[torch.Tensor, GDNTreeContext]],
    parents: torch.Tensor, accepted: torch.Tensor, stacks: GDNCommitStacks | None = None,
) -> None:
    """`GatedDeltaNet.commit` for all L layers at once: states [L, B, HV, dk, dv] and windows [L, B, C, 3] (the
    cache's stacks), `saved` one verify output per layer in the same order, `stacks` the context those verify
    calls wrote (layers stacked along the batch dim: ONE conv-commit and ONE fold launch, all layers sharing
    the tree and path, cover every layer instead of two launches per layer; only the keys are stacked here, a
    small copy). Without stacks (the recurrent baseline, a state snapshot per node) or with non-contiguous
    caches (a cache row view), layer by layer."""
    L, B = states.shape[:2]
    if stacks is None or not (states.is_contiguous() and windows.is_contiguous()):
        for j, layer_saved in enumerate(saved):
            GatedDeltaNet.commit(states[j], windows[j], layer_saved, parents, accepted)
        return
    flat_windows = windows.view(L * B, *windows.shape[2:])
    tree_conv_commit(stacks.mixed.flatten(0, 1), parents, accepted, flat_windows, out=flat_windows)
    stacked = GDNTreeContext(
        initial_state=states.view(L * B, *states.shape[2:]),
        k=torch.stack([ctx.k for _, ctx in saved]).flatten(0, 1),
        u=stacks.u.flatten(0, 1),
        G=stacks.G.flatten(0, 1),
    )
    gdn_tree_commit(stacked, accepted, out=stacked.initial_state)
