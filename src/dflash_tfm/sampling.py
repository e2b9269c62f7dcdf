"""Turning target logits into tokens: temperature, top-k, top-p, per-request seeded generators.

One path for every decoder: autoregressive sampling (`sample`) and speculative acceptance
(`spec.accept.target_draws`) both draw from `processed_probs`, so lossless speculative sampling matches plain
sampling exactly. Requests whose settings are greedy (`SamplingParams.greedy`, which covers temperatures and
top-p values too small to compute with) never reach `processed_probs`; for the rest, logits are shifted by their
maximum before scaling, in fp32, so the softmax sees values <= 0 and yields no inf or NaN.
"""
from __future__ import annotations

import torch

from dflash_tfm.sampling_params import SamplingParams


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """fp32 logits [..., V] -> probabilities after temperature, top-k and top-p (a non-greedy request)."""
    logits = logits.float()
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the token crossing the threshold stays)
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """logits [B, V] -> token ids [B] (argmax when greedy)."""
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = processed_probs(logits, params)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A generator seeded from the request's seed (None = the global RNG, so unseeded requests differ)."""
    if params.greedy or params.seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed)
    return gen
