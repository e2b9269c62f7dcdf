"""Which projections a target holds in FP8, and allocating them.

A checkpoint tensor ``X.weight`` is stored in FP8 exactly when ``X.weight_scale_inv`` sits beside it (decided
per tensor, not from `modules_to_not_convert`, which lists modules in the checkpoint's own naming). With
``--quantization fp8`` the BF16 tensors that would be FP8 in Qwen's releases are quantized at load instead:
every projection except those the releases keep in BF16 for precision (`KEPT_DENSE`: the MoE router and
shared-expert gate, the GDN `in_proj_a` / `in_proj_b` / Qwen3-Next `in_proj_ba`).

Our parameters fuse several checkpoint tensors (weight_map.py). A parameter receiving any FP8 tensor becomes an
`Fp8Weight`; the rows it receives from BF16 tensors must form one contiguous range, kept exact in the holder's
`dense` rows (true of every released layout: b | a at the end of the GDN in_proj, router | shared gate at the
start of the MoE in_proj). Only projections are ever held in FP8: an FP8 tensor that lands anywhere else
(embeddings, lm_head, norms, conv, A_log, dt_bias) is dequantized at load.
"""
from __future__ import annotations

import re
from collections import defaultdict

import torch
from torch import nn

from dflash_tfm.errors import CheckpointError
from dflash_tfm.kernels.fp8.block_quant import BLOCK, scale_shape
from dflash_tfm.layers.fp8_weight import Fp8Weight
from dflash_tfm.loading.weight_map import TensorSpec
from dflash_tfm.parallel.sharding import Part, take_part

SCALE_SUFFIX = "_scale_inv"
FP8_STORAGE = "F8_E4M3"
KEPT_DENSE = re.compile(r"(\.mlp\.gate|\.shared_expert_gate|\.in_proj_a|\.in_proj_b|\.in_proj_ba)\.weight$")


def scale_name(name: str) -> str:
    return name + SCALE_SUFFIX


def stored_fp8(names: set[str]) -> set[str]:
    """The checkpoint tensors stored in FP8: those with a scale beside them."""
    return {n[: -len(SCALE_SUFFIX)] for n in names if n.endswith(SCALE_SUFFIX)}


def scale_problems(source, specs: dict[str, TensorSpec], quantized: bool) -> list[str]:
    """Every `*_scale_inv` tensor checked against its weight: the config declares FP8, the weight is expected and
    stored as F8_E4M3, the scale has the block grid's shape. (Unexpected / missing weights are reported by the
    caller's own check.)"""
    names = set(source.tensor_names())
    problems = []
    for weight in sorted(stored_fp8(names)):
        scale = scale_name(weight)
        if not quantized:
            problems.append(f"unexpected tensor {scale!r}: quantization scales, but config.json declares no "
                            "quantization_config")
            continue
        if weight not in specs:
            if weight not in names:
                problems.append(f"unexpected tensor {scale!r} (no {weight!r} beside it)")
            continue
        want, have = scale_shape(specs[weight].shape), tuple(source.tensor_shape(scale))
        if have != want:
            problems.append(f"tensor {scale!r}: expected shape {list(want)} for a weight of shape "
                            f"{list(specs[weight].shape)} in 128 x 128 blocks, found {list(have)}")
        stored = source.tensor_dtype(weight)
        if stored != FP8_STORAGE:
            problems.append(f"tensor {weight!r} has a scale but is stored as {stored}, not {FP8_STORAGE}")
    for weight in sorted(n for n in names if n not in stored_fp8(names) and n in specs):
        if source.tensor_dtype(weight).startswith("F8"):
            problems.append(f"tensor {weight!r} is stored as {source.tensor_dtype(weight)} without a "
                            f"{scale_name(weight)!r} beside it")
    return problems


def fp8_plan(specs: dict[str, TensorSpec], fp8_names: set[str]) -> dict[str, tuple[int, int] | None]:
    """Parameter name -> its exact (BF16) row range, or None when all its rows are FP8, for every parameter that
    receives an FP8 tensor. The pieces' rows come from running each spec's mapping on a meta tensor."""
    rows: dict[str, list[tuple[int, int, str]]] = defaultdict(list)
    for name, spec in specs.items():
        for param, row, piece in spec.assign(torch.empty(spec.read_shape, device="meta")):
            n = piece.flatten(0, -2).shape[0] if piece.dim() > 2 else piece.shape[0]
            rows[param].append((row, row + n, name))
    plan = {}
    for param, parts in rows.items():
        if not any(name in fp8_names for *_, name in parts):
            continue
        dense = sorted((lo, hi, name) for lo, hi, name in parts if name not in fp8_names)
        if not dense:
            plan[param] = None
            continue
        lo, hi = dense[0][0], dense[-1][1]
        if sum(h - low for low, h, _ in dense) != hi - lo:
            raise CheckpointError(f"{param} fuses FP8 tensors with BF16 ones that are not one contiguous row range "
                                  f"({', '.join(name for *_, name in dense)} in BF16)")
        plan[param] = (lo, hi)
    return plan


def allocate_projections(model: nn.Module, plan: dict[str, tuple[int, int] | None], device: torch.device,
                         dtype: torch.dtype) -> None:
    """Give every projection left on the meta device (`layers.linear.deferred_projection_weights`) its storage:
    an `Fp8Weight` when the plan names it, else an empty `dtype` parameter; a parameter already allocated that the
    plan names is replaced the same way."""
    for name, param in list(model.named_parameters()):
        if not (param.is_meta or name in plan):
            continue
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        if name in plan:
            del owner._parameters[attr]
            setattr(owner, attr, Fp8Weight(tuple(param.shape), plan[name], dtype, device))
        else:
            setattr(owner, attr, nn.Parameter(torch.empty(param.shape, dtype=dtype, device=device),
                                              requires_grad=False))


def slice_row_scales(scales: torch.Tensor, part: Part | None, name: str, columns: int) -> torch.Tensor:
    """Per-row scales ``[..., N, ⌈K/128⌉]`` of a whole FP8 tensor -> those of the tensor-parallel slice `part`
    (`parallel/sharding.py`) a rank reads. Per-row scales follow any range of rows (or experts); a range of the
    K = `columns` columns must start on a 128-column block and span whole blocks (or end at K), since the
    rank's scales are whole blocks from its column 0."""
    if part is None or part[0] % scales.dim() != scales.dim() - 1:
        return take_part(scales, part)
    dim, ranges = part
    for start, n in ranges:
        if start % BLOCK or (n % BLOCK and start + n != columns):
            raise CheckpointError(f"tensor {name!r}: this tensor-parallel split reads columns {start} … "
                                  f"{start + n - 1}, which do not fall on its FP8 scales' 128-column blocks; "
                                  "choose a --tp-size whose column slices are multiples of 128")
    return take_part(scales, (dim, tuple((start // BLOCK, -(-n // BLOCK)) for start, n in ranges)))
