"""Sparse mixture-of-experts feed-forward (Qwen3.5-MoE, Qwen3-Next): a softmax router picks each token's top-k
experts, each a SwiGLU, whose outputs are mixed by the router probabilities (renormalised over the k when the
config says so), and a shared expert scaled by a sigmoid gate is added for every token.

The block is per token, so prefill, a decode step and a tree verify (every node one row) all go through the same
`forward`. The routed experts run as grouped GEMMs over expert-sorted row blocks on CUDA (capture-safe, each
active expert's weights read once; `kernels/moe/grouped_experts.py`) and as their PyTorch twin elsewhere
(`kernels/moe/reference.py`).

Rounding follows transformers: router logits in the activations' dtype, softmax and renormalisation in fp32, the
mixing weights cast back, expert outputs weighted and summed per token in the activations' dtype.
"""
from __future__ import annotations

import torch
from torch import nn

from dflash_tfm.kernels.moe.grouped_experts import routed_experts
from dflash_tfm.kernels.moe.reference import routed_experts_reference
from dflash_tfm.layers.fp8_weight import Fp8Weight
from dflash_tfm.layers.linear import linear, projection_weight
from dflash_tfm.layers.mlp import silu_and_mul


class SparseMoE(nn.Module):
    """Routed experts plus a gated shared expert.

    Everything that reads the normed token straight away is one projection, `in_proj`, whose rows are the router
    (E), the shared expert's gate (1) and the shared expert's gate | up (2 · S), so a token is read once for all
    three. Expert weights are stacked: `experts_gate_up` [E, 2I, H] (gate rows, then up rows, per expert) and
    `experts_down` [E, H, I], as transformers keeps them.
    """

    def __init__(
        self, hidden_size: int, num_experts: int, top_k: int, expert_width: int, shared_width: int,
        normalise_top_k: bool, local_experts: tuple[int, int] | None = None,
    ) -> None:
        """local_experts: (first, count) of the experts this expert-parallel rank holds (`parallel/sharding.py`);
        the router still scores all `num_experts`, and assignments to the others add nothing here."""
        super().__init__()
        self.num_experts, self.top_k, self.normalise_top_k = num_experts, top_k, normalise_top_k
        self.local_experts = local_experts
        held = num_experts if local_experts is None else local_experts[1]
        self.in_proj = projection_weight(num_experts + 1 + 2 * shared_width, hidden_size)
        self.shared_down = projection_weight(hidden_size, shared_width)
        self.experts_gate_up = projection_weight(held, 2 * expert_width, hidden_size)
        self.experts_down = projection_weight(held, hidden_size, expert_width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H] (normed) -> [..., H]."""
        rows = x.reshape(-1, x.shape[-1])
        shared_width = self.shared_down.shape[1]
        router_logits, shared_gate, shared_gate_up = linear(rows, self.in_proj).split(
            [self.num_experts, 1, 2 * shared_width], dim=-1)
        weights, experts = route(router_logits, self.top_k, self.normalise_top_k)
        weights = weights.to(x.dtype)
        if isinstance(self.experts_gate_up, Fp8Weight):
            routed = fp8_routed_experts(rows, weights, self.held_here(experts), self.experts_gate_up,
                                        self.experts_down)
        else:
            routed = routed_experts(rows, weights, self.held_here(experts), self.experts_gate_up, self.experts_down,
                                    elsewhere=self.local_experts is not None)
        shared = torch.sigmoid(shared_gate) * linear(silu_and_mul(shared_gate_up), self.shared_down)
        return (routed + shared).view(x.shape)

    def held_here(self, experts: torch.Tensor) -> torch.Tensor:
        """Global expert ids [T, k] -> ids into this rank's expert stacks, −1 for an expert another rank holds."""
        if self.local_experts is None:
            return experts
        first, count = self.local_experts
        local = experts - first
        return torch.where((local >= 0) & (local < count), local, -1)


def route(router_logits: torch.Tensor, top_k: int, normalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (fp32 mixing weights [T, k], expert ids [T, k]): softmax over all experts, the k
    most probable, renormalised to sum to 1 when `normalise`."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = probs.topk(top_k, dim=-1)
    if normalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def fp8_routed_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: Fp8Weight,
                       down: Fp8Weight) -> torch.Tensor:
    """The routed experts of FP8 expert stacks: each assignment's expert gathered and dequantised to x's dtype,
    then the twin's batched products over those copies (static shapes, capture-safe). Correct, but it reads k · T
    dequantised copies rather than streaming the FP8 bytes once per active expert: the grouped kernel takes
    BF16 weights only so far."""
    ids = experts.flatten().clamp(min=0)  # −1 (held by another rank): a copy of expert 0, left out of the sum
    slots = torch.arange(ids.numel(), device=ids.device).view_as(experts)  # assignment i uses copy i
    slots = torch.where(experts >= 0, slots, -1)
    return routed_experts_reference(x, weights, slots, gate_up[ids].dequantize(x.dtype),
                                    down[ids].dequantize(x.dtype))
