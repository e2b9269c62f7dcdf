"""Run a function on `tp` CPU processes joined by gloo, as `torchrun` would start them, and hand every rank's
result back to the test."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable

import torch
import torch.multiprocessing as mp

from dflash_tfm.parallel.group import destroy_tensor_parallel, init_tensor_parallel


def _rank_main(rank: int, tp: int, rdzv: str, out: Path, fn: Callable, args: tuple) -> None:
    torch.set_num_threads(1)  # tp processes on a 2-core machine
    init_tensor_parallel(tp, "cpu", rank=rank, init_method=rdzv)
    try:
        torch.save(fn(rank, tp, *args), out / f"rank{rank}.pt")
    finally:
        destroy_tensor_parallel()
    # The result is saved and the group left; ending the process here skips the interpreter's own teardown, where
    # gloo's threads were seen to abort it (SIGABRT, "terminate called without an active exception") about once
    # in the 46 tests on a loaded 2-core machine, failing a test whose ranks had all succeeded.
    os._exit(0)


def run_ranks(tp: int, fn: Callable, *args) -> list:
    """`fn(rank, tp, *args)` on `tp` spawned processes inside one gloo group; every rank's return value, by
    rank. `fn` must be a module-level function (spawned processes import it)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        mp.spawn(_rank_main, args=(tp, f"file://{out / 'rdzv'}", out, fn, args), nprocs=tp, join=True)
        return [torch.load(out / f"rank{r}.pt") for r in range(tp)]
