"""The routed experts of a sparse mixture-of-experts block in plain PyTorch: the twin of `grouped_experts.py`, and
what the CPU runs.

Assignment (t, j), token t's j-th choice, is row ``t · k + j`` (token-major). Each assignment's output is its
expert's SwiGLU of token t; the block's routed output is the per-token sum of those outputs times the mixing
weights. The outputs are computed in one of two ways with the same result:

* `gathered_expert_outputs`: every assignment gathers its expert's weights and multiplies by them in batched
  matmuls. Static shapes and no host read, so it can be captured in a CUDA graph; when the assignments are at
  most the experts it also reads no more weight than there are experts to read (a decode step: k of E).
* `grouped_expert_outputs`: the assignments sorted by expert, so each active expert's weights are read once for
  all of its tokens. It needs one host read (the tokens per expert), so it runs only outside a capture.

Rounding follows transformers: gate | up, the SwiGLU and the expert output in the activations' dtype, the
weighted outputs in that dtype, summed per token.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def routed_experts_reference(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
                             down: torch.Tensor) -> torch.Tensor:
    """x [T, H], mixing weights [T, k] (x's dtype), expert ids [T, k], gate_up [E, 2I, H] (gate rows, then up
    rows), down [E, H, I] -> Σ_j weights[t, j] · SwiGLU_{experts[t, j]}(x[t]) [T, H]. An id of −1 is an expert
    another expert-parallel rank holds: its assignment adds nothing here."""
    held = experts >= 0
    return mix(expert_outputs(x, experts.clamp(min=0), gate_up, down), weights, held)


def mix(outputs: torch.Tensor, weights: torch.Tensor, held: torch.Tensor | None = None) -> torch.Tensor:
    """Per-assignment expert outputs [T · k, H] (token-major) and weights [T, k] -> their weighted sum per token
    [T, H], over the assignments `held` [T, k] only (all when None): the others' outputs are left out, not
    multiplied by zero, which an infinite output would turn into NaN."""
    tokens, k = weights.shape
    weighted = outputs.view(tokens, k, -1) * weights.unsqueeze(-1)
    if held is not None:
        weighted = torch.where(held.unsqueeze(-1), weighted, 0)
    return weighted.sum(dim=1)


def expert_outputs(x: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """Each assignment's expert SwiGLU output [T · k, H], token-major; gathered while a CUDA graph is being captured
    or when the assignments are no more than the experts, grouped otherwise (module docstring)."""
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    if capturing or experts.numel() <= gate_up.shape[0]:
        return gathered_expert_outputs(x, experts, gate_up, down)
    return grouped_expert_outputs(x, experts, gate_up, down)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] laid out [gate | up] -> silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gathered_expert_outputs(x: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
                            down: torch.Tensor) -> torch.Tensor:
    """x [T, H], experts [T, k] -> [T · k, H]: each assignment multiplies its token by its own gathered copy of the
    expert's weights (batched matrix-vector products)."""
    ids = experts.flatten()
    tokens = x.repeat_interleave(experts.shape[1], dim=0).unsqueeze(-1)  # [T·k, H, 1]
    hidden = silu_and_mul(torch.bmm(gate_up[ids], tokens).squeeze(-1))
    return torch.bmm(down[ids], hidden.unsqueeze(-1)).squeeze(-1)


def grouped_expert_outputs(x: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
                           down: torch.Tensor) -> torch.Tensor:
    """x [T, H], experts [T, k] -> [T · k, H]: the assignments sorted by expert (stable, so tokens keep their order
    inside an expert), each active expert's rows multiplied by its weights in one GEMM pair, and the results put
    back in token-major order."""
    ids = experts.flatten()
    order = ids.argsort(stable=True)
    grouped_rows = x.index_select(0, order // experts.shape[1])
    per_expert = torch.bincount(ids, minlength=gate_up.shape[0]).tolist()  # the one host read
    outputs = [F.linear(silu_and_mul(F.linear(rows, gate_up[e])), down[e])
               for e, rows in enumerate(grouped_rows.split(per_expert)) if rows.shape[0]]
    token_major = torch.empty(ids.shape[0], x.shape[-1], dtype=x.dtype, device=x.device)
    token_major[order] = torch.cat(outputs)
    return token_major
