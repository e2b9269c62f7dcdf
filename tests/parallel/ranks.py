"""Run a function on `tp` CPU processes joined by gloo, as `torchrun` would start them, and hand rank 0's result
back to the test (every rank computes; rank 0 reports)."""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable

import torch
import torch.multiprocessing as mp

from dflash_tfm.parallel.group import destroy_tensor_parallel, init_tensor_parallel


def _rank_main(rank: int, tp: int, rdzv: str, out: str, fn: Callable, args: tuple) -> None:
    torch.set_num_threads(1)  # tp processes on a 2-core machine
    init_tensor_parallel(tp, "cpu", rank=rank, init_method=rdzv)
    try:
        result = fn(rank, tp, *args)
        if rank == 0:
            torch.save(result, out)
    finally:
        destroy_tensor_parallel()


def run_ranks(tp: int, fn: Callable, *args) -> object:
    """`fn(rank, tp, *args)` on `tp` spawned processes inside one gloo group; rank 0's return value. `fn` must
    be a module-level function (spawned processes import it)."""
    with tempfile.TemporaryDirectory() as tmp:
        rdzv, out = f"file://{Path(tmp) / 'rdzv'}", str(Path(tmp) / "result.pt")
        mp.spawn(_rank_main, args=(tp, rdzv, out, fn, args), nprocs=tp, join=True)
        return torch.load(out)
