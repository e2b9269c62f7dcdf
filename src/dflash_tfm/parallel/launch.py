"""Starting the ranks of `--tp-size N` from the command itself, as SGLang's and vLLM's launchers do.

A user types `dflash-tfm generate --tp-size 2 ...` or `python -m dflash_tfm.launch_server --tp-size 2 ...`;
if no launcher started the process (no WORLD_SIZE in its environment), the command runs itself again as N
processes under PyTorch's own launcher (`torch.distributed.run --standalone`: a free local rendezvous port, one
process per rank, a failing rank stops the others) and returns the launcher's exit status. Under `torchrun` (or
any launcher that sets WORLD_SIZE) nothing is relaunched.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

from dflash_tfm.parallel.sharding import check_ep_size


def launched_by_a_launcher() -> bool:
    return "WORLD_SIZE" in os.environ


def check_devices(tp_size: int, device: str | None) -> None:
    """Raise ValueError, naming the flag, when `device` (None: CUDA if available) lacks `tp_size` GPUs. On the
    CPU any number of ranks can run (gloo)."""
    import torch

    cuda = device.startswith("cuda") if device else torch.cuda.is_available()
    if cuda and torch.cuda.device_count() < tp_size:
        raise ValueError(f"--tp-size {tp_size} needs {tp_size} GPUs, this machine has {torch.cuda.device_count()}")


def relaunch(tp_size: int, module: str, argv: list[str], device: str | None, ep_size: int = 1) -> int:
    """Run `python -m module argv` as `tp_size` ranks under `torch.distributed.run --standalone` and wait for
    them; the launcher's exit status (0 when every rank succeeded). Output goes where this process's goes. Sizes
    the ranks cannot run (too few devices, an --ep-size unlike the --tp-size) are refused here, once, before any
    rank starts (ValueError)."""
    check_devices(tp_size, device)
    check_ep_size(tp_size, ep_size)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(tp_size),
           "-m", module, *argv]
    launcher = subprocess.Popen(cmd)
    # A stop request for this process (a service manager's SIGTERM, Ctrl-C) goes on to the launcher, which stops
    # its ranks: none is left behind holding a GPU or the server's port.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: launcher.send_signal(signum))
    try:
        while True:
            try:
                return launcher.wait()
            except KeyboardInterrupt:
                launcher.send_signal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGTERM, previous)
