"""Depthwise causal conv1d (width K) that continues from a cached window of the last K-1 inputs."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, T, C], weight [C, K], window [B, C, K-1] (oldest first) -> (silu(conv) [B, T, C], new window).

    y_t = silu(sum_s weight[:, s] * x_{t-K+1+s}) with fp32 accumulation (like cuDNN's conv1d); inputs
    before the first token come from `window`, so prefill (zero window) and decode share one code path.
    Written as unfold + weighted sum so inductor fuses it with its neighbours.
    """
    K = weight.shape[1]
    T = x.shape[1]
    xs = torch.cat((window.to(x.dtype), x.transpose(1, 2)), dim=-1)  # [B, C, K-1+T]
    y = (xs.float().unfold(-1, K, 1) * weight.float().unsqueeze(1)).sum(-1)  # [B, C, T]
    return F.silu(y).to(x.dtype).transpose(1, 2), xs[:, :, T:]
