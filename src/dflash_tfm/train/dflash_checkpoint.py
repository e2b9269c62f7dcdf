"""A trainable DFlash drafter for a target, and its export in the published z-lab layout.

The drafter is built from the same `config.json` dict that is later saved, through `DFlashConfig.from_dict`,
so what trains is exactly what `load_dflash_drafter` rebuilds. Tensors are exported through the inverse of
`checkpoint_tensors` (the loader's own name -> parameter map), so names and shapes cannot diverge either.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from dflash_tfm.models.decoder import CausalLM
from dflash_tfm.spec.dflash import DFlashDrafter, checkpoint_tensors
from dflash_tfm.spec.dflash_config import DFlashConfig

INIT_STD = 0.02  # the Qwen3 / Llama initializer_range


def default_mask_token_id(tokenizer: object | None, vocab_size: int) -> int:
    """The id fed at block positions 1 .. B-1. Its embedding is the target's (frozen), so any id works
    functionally; one that never occurs in chat data keeps the mask distinguishable from a real root token.

    Order: the tokenizer's own mask token; else the highest added/special id that is not bos/eos/pad/unk and
    does not occur in a rendered chat (SmolLM2: 16 `<empty_output>`, a StarCoder-era special unused in chat);
    else, without a tokenizer or such an id, the last id of the vocabulary (the test fixtures' choice).
    Real Qwen targets ship a dedicated id (Qwen3.6: 248070): pass it explicitly.
    """
    if tokenizer is None:
        return vocab_size - 1
    mask = getattr(tokenizer, "mask_token_id", None)
    if isinstance(mask, int) and 0 <= mask < vocab_size:
        return mask
    reserved = {getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "pad", "unk")}
    try:
        chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
        ids = tokenizer.apply_chat_template(chat, tokenize=True)  # type: ignore[attr-defined]
        reserved |= set(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)
    except (AttributeError, ValueError, TypeError):
        pass  # no chat template: nothing more to reserve
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    free = [i for i in added if 0 <= i < vocab_size and i not in reserved]
    return max(free) if free else vocab_size - 1


def build_trainable_drafter(raw_config: dict, target: CausalLM, seed: int) -> DFlashDrafter:
    """A freshly initialised drafter with fp32 (master) weights and gradients on, sharing the target's frozen
    embeddings and lm_head. Matrices ~ N(0, INIT_STD), norm weights 1 (starting the final norm from the
    target's instead was tried on SmolLM2: its large weights make the first logits far too confident)."""
    cfg = DFlashConfig.from_dict(raw_config)
    cfg.check_fits(target.config)
    drafter = DFlashDrafter(cfg, target).float()
    gen = torch.Generator(device=drafter.fc.device).manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, INIT_STD, generator=gen)
    return drafter.requires_grad_(True).train()


def checkpoint_state(drafter: DFlashDrafter) -> dict[str, torch.Tensor]:
    """Checkpoint name -> the slice of our (fused) parameter it comes from: `checkpoint_tensors` read backwards."""
    params = dict(drafter.named_parameters())
    state = {}
    for name, spec in checkpoint_tensors(drafter.config).items():
        pieces = spec.assign(torch.empty(spec.shape, device="meta"))
        if len(pieces) != 1:
            raise NotImplementedError(f"{name} maps to {len(pieces)} parameter pieces; export expects one")
        param, row, _ = pieces[0]
        state[name] = params[param][row : row + spec.shape[0]]
    return state


def save_drafter(drafter: DFlashDrafter, raw_config: dict, out_dir: str | Path, dtype: torch.dtype) -> Path:
    """Write `config.json` + `model.safetensors` (weights in `dtype`) into `out_dir`; returns it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu", dtype).contiguous() for name, t in checkpoint_state(drafter).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(dict(raw_config, dtype=str(dtype).removeprefix("torch.")), indent=2))
    return out
