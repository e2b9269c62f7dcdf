"""The tensor-parallel process group: one process per rank, started by the command itself (`parallel/launch.py`),
by `torchrun` (or any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT) or given explicitly by a
test.

The group is process-wide state, as in vLLM and SGLang: the decoder's row-parallel projections call
`all_reduce` without being handed a group, and at tp 1 (no group set up) `all_reduce` returns its input at the
cost of one Python check, so a single-GPU run launches no collective and changes no result. NCCL is the backend
on CUDA, gloo on the CPU (so the tests run on any machine); only gloo has been run so far.
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

_size = 1
_rank = 0


def init_tensor_parallel(tp_size: int, device_type: str, rank: int | None = None,
                         init_method: str | None = None) -> torch.device:
    """Join a group of `tp_size` processes and return this rank's device (`cuda:<LOCAL_RANK>` on CUDA, else the
    CPU). The rank and rendezvous come from the torchrun environment unless given (`init_method`, e.g.
    "tcp://127.0.0.1:29511" or "file:///tmp/rdzv"); a process group already set up (by a program embedding the
    engine) is joined as it is. The whole world is the tensor-parallel group: a world of another size is refused,
    naming the flag."""
    global _size, _rank
    if tp_size < 2:
        raise ValueError(f"a tensor-parallel group needs --tp-size 2 or more, got {tp_size} (1 needs no group)")
    if dist.is_initialized():
        world, own_rank = dist.get_world_size(), dist.get_rank()
    else:
        world, own_rank = int(os.environ.get("WORLD_SIZE", tp_size if init_method else 1)), int(os.environ.get("RANK", 0))
    if world != tp_size:
        raise ValueError(f"--tp-size {tp_size} needs {tp_size} processes, but WORLD_SIZE is {world}: run the "
                         f"command without a launcher (it starts its ranks) or with `--nproc-per-node {tp_size}`")
    rank = own_rank if rank is None else rank
    backend = "nccl" if device_type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method or "env://", rank=rank, world_size=tp_size,
                                timeout=timedelta(minutes=10))
    _size, _rank = tp_size, rank
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
        return device
    return torch.device(device_type)


def destroy_tensor_parallel() -> None:
    """Leave the group (back to tp 1), on every rank once all have arrived: a process that exits with the group
    still up, or while another rank is still receiving from it, can abort inside gloo's threads."""
    global _size, _rank
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    _size, _rank = 1, 0


def tp_size() -> int:
    return _size


def tp_rank() -> int:
    return _rank


def is_first_rank() -> bool:
    """Rank 0 prints and answers; the others compute in lockstep and stay silent."""
    return _rank == 0


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of `x` over the ranks, in place (a row-parallel projection's partial outputs); `x` itself at tp 1."""
    if _size > 1:
        dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim` in rank order (a vocab-parallel lm_head's logits); `x` at tp 1."""
    if _size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def broadcast_object(obj: object) -> object:
    """Rank 0's `obj` on every rank (a request's random seed, so every rank samples the same tokens)."""
    if _size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
