"""Sparse mixture-of-experts feed-forward (Qwen3.5-MoE, Qwen3-Next): a softmax router picks each token's top-k
experts, each a SwiGLU, whose outputs are mixed by the router probabilities (renormalised over the k when the
config says so), and a shared expert scaled by a sigmoid gate is added for every token.

The block is per token, so prefill, a decode step and a tree verify (every node one row) all go through the same
`forward`. This is the pure-PyTorch definition the GPU kernels (grouped GEMMs) will be checked against. The
routed experts run in one of two ways with the same result:

* `gathered_expert_outputs`: every (token, slot) assignment gathers its expert's weights and multiplies by them
  in batched matmuls. Static shapes and no host read, so it can be captured in a CUDA graph; when the
  assignments are at most the experts it also reads no more weight than there are experts to read (a decode
  step: k of E).
* `grouped_expert_outputs`: the assignments sorted by expert, so each active expert's weights are read once for
  all of its tokens. It needs one host read (the tokens per expert), so it runs only outside a capture, for many
  tokens (prefill chunks, eager tree verify).

Rounding follows transformers: router logits in the activations' dtype, softmax and renormalisation in fp32, the
mixing weights cast back, expert outputs weighted and summed per token in the activations' dtype.
"""
from __future__ import annotations

import torch
from torch import nn

from dflash_tfm.layers.fp8_weight import dense_weight
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
        normalise_top_k: bool,
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.normalise_top_k = num_experts, top_k, normalise_top_k
        self.in_proj = projection_weight(num_experts + 1 + 2 * shared_width, hidden_size)
        self.shared_down = projection_weight(hidden_size, shared_width)
        self.experts_gate_up = projection_weight(num_experts, 2 * expert_width, hidden_size)
        self.experts_down = projection_weight(num_experts, hidden_size, expert_width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H] (normed) -> [..., H]."""
        rows = x.reshape(-1, x.shape[-1])
        shared_width = self.shared_down.shape[1]
        router_logits, shared_gate, shared_gate_up = linear(rows, self.in_proj).split(
            [self.num_experts, 1, 2 * shared_width], dim=-1)
        weights, experts = route(router_logits, self.top_k, self.normalise_top_k)
        routed = mix(expert_outputs(rows, experts, self.experts_gate_up, self.experts_down), weights.to(x.dtype))
        shared = torch.sigmoid(shared_gate) * linear(silu_and_mul(shared_gate_up), self.shared_down)
        return (routed + shared).view(x.shape)


def route(router_logits: torch.Tensor, top_k: int, normalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (fp32 mixing weights [T, k], expert ids [T, k]): softmax over all experts, the k
    most probable, renormalised to sum to 1 when `normalise`."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = probs.topk(top_k, dim=-1)
    if normalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def mix(outputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Per-assignment expert outputs [T · k, H] (token-major) and weights [T, k] -> their weighted sum per token
    [T, H]."""
    tokens, k = weights.shape
    return (outputs.view(tokens, k, -1) * weights.unsqueeze(-1)).sum(dim=1)


def expert_outputs(x: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """Each (token, slot) assignment's expert SwiGLU output [T · k, H], token-major; picks the gathered or grouped
    way (module docstring): gathered while a CUDA graph is being captured or when the assignments are no more than
    the experts, grouped otherwise."""
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    if capturing or experts.numel() <= gate_up.shape[0]:
        return gathered_expert_outputs(x, experts, gate_up, down)
    return grouped_expert_outputs(x, experts, gate_up, down)


def gathered_expert_outputs(x: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
                            down: torch.Tensor) -> torch.Tensor:
    """x [T, H], experts [T, k] -> [T · k, H]: each assignment multiplies its token by its own gathered copy of the
    expert's weights (batched matrix-vector products; FP8 experts are dequantised once gathered)."""
    ids = experts.flatten()
    tokens = x.repeat_interleave(experts.shape[1], dim=0).unsqueeze(-1)  # [T·k, H, 1]
    hidden = silu_and_mul(torch.bmm(dense_weight(gate_up[ids], x.dtype), tokens).squeeze(-1))
    return torch.bmm(dense_weight(down[ids], x.dtype), hidden.unsqueeze(-1)).squeeze(-1)


def grouped_expert_outputs(x: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
                           down: torch.Tensor) -> torch.Tensor:
    """x [T, H], experts [T, k] -> [T · k, H]: the assignments sorted by expert (stable, so tokens keep their order
    inside an expert), each active expert's rows multiplied by its weights in one GEMM pair, and the results put
    back in token-major order."""
    ids = experts.flatten()
    order = ids.argsort(stable=True)
    grouped_rows = x.index_select(0, order // experts.shape[1])
    per_expert = torch.bincount(ids, minlength=gate_up.shape[0]).tolist()  # the one host read
    outputs = [linear(silu_and_mul(linear(rows, gate_up[e])), down[e])
               for e, rows in enumerate(grouped_rows.split(per_expert)) if rows.shape[0]]
    token_major = torch.empty(ids.shape[0], x.shape[-1], dtype=x.dtype, device=x.device)
    token_major[order] = torch.cat(outputs)
    return token_major
