"""Training forward of the DFlash drafter: N blocks per sequence in one pass, through the drafter's own layers.

Inference (`DFlashDrafter.draft`) runs one block `[root, MASK x (B-1)]` at positions L .. L+B-1 against the
cached context K/V of positions 0 .. L-1. Training runs N such blocks per sequence at once, anchored at
a_1 .. a_N (block j's root is the sequence's own token at a_j). Keys are laid out on one axis per sequence,

    slots [0, T)            context K/V of every position (each layer's k/v_proj of hidden_norm(fc(taps)))
    slots [T + jB, T + jB + B)   block j's own K/V

and `block_attention_mask` lets a query of block j see the context positions p < a_j and its own block, under
the same window / in-block causality rules as inference (`dflash.attention_mask`); blocks never see each other.

Each layer is `DFlashLayer.forward` itself, unchanged: it rotates q/k with `rope(q, k, positions)` and writes the
block's K/V into the cache it is handed at `positions`. Training passes the blocks' SLOTS as `positions` and a
`SlotRope` that maps every slot to its absolute position before rotating. So the block path (norms,
projections, q/k norm, RoPE, grouped attention, MLP) is one piece of code for inference and training, and a
test holds the two equal (tests/train/test_train_dflash.py).

The dense mask costs O(N*B x (T + N*B)) per sequence: fine for the short contexts a small target is trained
on; long-context training would want a block-sparse kernel (flex attention) instead.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash_tfm.layers.rotary import RotaryEmbedding
from dflash_tfm.spec.dflash import DFlashDrafter


class SlotRope:
    """Stands in for the drafter's `RotaryEmbedding` inside `DFlashLayer.forward`: `positions` arrive as cache
    slots [b, n] and are rotated at `slot_positions[b, slot]`, the absolute position stored in that slot."""

    def __init__(self, rope: RotaryEmbedding, slot_positions: torch.Tensor) -> None:
        self.rope = rope
        self.slot_positions = slot_positions  # [b, S] long

    def __call__(self, q: torch.Tensor, k: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rope(q, k, self.slot_positions.gather(1, slots))


def block_attention_mask(
    anchors: torch.Tensor, seq_len: int, block_size: int, window: int | None, causal: bool
) -> torch.Tensor:
    """anchors [b, N] -> bool [b, 1, N*B, T + N*B]: which keys each block query sees (layout in the module doc).

    Query i of block j sits at q = a_j + i. Context key p: p < a_j, and q - p < W on sliding layers. Key i' of
    the same block: i' <= i when `causal`, |i - i'| < W on sliding layers (i - i' < W when causal too).
    """
    b, N = anchors.shape
    B, device = block_size, anchors.device
    offsets = torch.arange(B, device=device)
    qpos = (anchors.unsqueeze(-1) + offsets).view(b, N * B, 1)
    key_pos = torch.arange(seq_len, device=device).view(1, 1, -1)
    context = key_pos < anchors.repeat_interleave(B, dim=1).unsqueeze(-1)
    if window is not None:
        context = context & (qpos - key_pos < window)
    d = offsets.view(B, 1) - offsets.view(1, B)  # query offset - key offset
    inner = torch.ones(B, B, dtype=torch.bool, device=device)
    if causal:
        inner = inner & (d >= 0)
    if window is not None:
        inner = inner & (d < window) & (-d < window)
    index = torch.arange(N * B, device=device)
    same_block = (index.view(-1, 1) // B) == (index.view(1, -1) // B)
    own = same_block & inner[index.view(-1, 1) % B, index.view(1, -1) % B]
    return torch.cat((context, own.expand(b, -1, -1)), dim=-1).unsqueeze(1)


def block_forward(
    drafter: DFlashDrafter, features: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor
) -> torch.Tensor:
    """Final-normed hidden states of N blocks per sequence, block positions 1 .. B-1.

    features [b, T, K*H_target]: the target's tap outputs for tokens [b, T] (position p's features are context
    for anchors > p); anchors [b, N] with 0 <= a < T. Returns [b, N, B-1, H]; `lm_head` on entry k of block j
    predicts token a_j + k. Needs `drafter.allocate(n)` with n > max(anchors) + B - 1 (RoPE table).
    """
    cfg = drafter.config
    b, T = tokens.shape
    N, B = anchors.shape[1], cfg.block_size
    device = tokens.device
    ctx = drafter.hidden_norm(F.linear(features.to(drafter.fc.dtype), drafter.fc))
    ctx_pos = torch.arange(T, device=device).expand(b, T)
    roots = tokens.gather(1, anchors).unsqueeze(-1)
    ids = torch.cat((roots, roots.new_full((b, N, B - 1), cfg.mask_token_id)), dim=-1).view(b, N * B)
    h = F.embedding(ids, drafter.embed_tokens)
    block_pos = (anchors.unsqueeze(-1) + torch.arange(B, device=device)).view(b, N * B)
    slots = (T + torch.arange(N * B, device=device)).expand(b, -1)
    rope = SlotRope(drafter.rope, torch.cat((ctx_pos, block_pos), dim=1))
    groups = cfg.num_heads // cfg.num_kv_heads
    masks = {
        sliding: block_attention_mask(
            anchors, T, B, cfg.sliding_window if sliding else None, sliding and cfg.causal_sliding_in_block
        ).repeat(1, 1, groups, 1)
        for sliding in {layer.sliding for layer in drafter.layers}
    }
    for layer in drafter.layers:
        k, v = layer.context_kv(ctx, ctx_pos, drafter.rope)
        k_slots = torch.cat((k, k.new_zeros(b, N * B, *k.shape[2:])), dim=1)
        v_slots = torch.cat((v, v.new_zeros(b, N * B, *v.shape[2:])), dim=1)
        h = layer(h, slots, rope, k_slots, v_slots, T + N * B, masks[layer.sliding])  # type: ignore[arg-type]
    return drafter.norm(h).view(b, N, B, -1)[:, :, 1:]
