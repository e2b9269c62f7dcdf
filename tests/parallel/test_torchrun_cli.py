"""`torchrun --nproc-per-node 2 -m dflash_tfm.cli generate --tp-size 2`: two gloo processes, rank 0 prints the
same text as one process at --tp-size 1, the others print nothing; a --tp-size the launch does not match is one
line naming the flag."""
from __future__ import annotations

import os
import subprocess
import sys

from dflash_tfm.cli import main
from dflash_tfm.config import ModelConfig
from dflash_tfm.loading.loader import open_checkpoint
from dflash_tfm.spec.fixtures import write_random_dflash_checkpoint

from ..train.tiny_chat import save_tiny_chat_model


def generate(args: list[str], launcher: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([*launcher, "-m", "dflash_tfm.cli", "generate", *args], capture_output=True, text=True,
                          timeout=600, env=env)


def test_torchrun_tp2_prints_what_tp1_prints(tmp_path) -> None:
    path = save_tiny_chat_model(tmp_path)
    cfg = ModelConfig.from_dict(open_checkpoint(path)[1])
    drafter = write_random_dflash_checkpoint(tmp_path / "dflash", cfg, block_size=8,
                                             target_layer_ids=[0, cfg.num_layers - 1])
    args = ["--model-path", str(path), "--device", "cpu", "--prompt", "hello world how many", "--max-new-tokens",
            "24", "--speculative-algorithm", "DDTREE", "--speculative-draft-model-path", str(drafter)]
    single = generate([*args, "--tp-size", "1"], [sys.executable])
    assert single.returncode == 0, single.stderr
    split = generate([*args, "--tp-size", "2"],
                     [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"])
    assert split.returncode == 0, split.stderr
    assert split.stdout == single.stdout and single.stdout.strip()
    assert split.stderr.count("tok/s") == 1  # rank 0 alone reports


def test_tp_size_without_its_processes_is_one_line_error(capsys) -> None:
    assert main(["generate", "--prompt", "x", "--device", "cpu", "--tp-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "--tp-size 2 needs 2 processes" in err and "torchrun" in err and "Traceback" not in err
