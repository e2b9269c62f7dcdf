"""`torchrun --nproc-per-node 2 -m dflash_tfm.cli generate --tp-size 2`: two gloo processes, rank 0 prints the
same text as one process at --tp-size 1, the others print nothing; without torchrun the command starts its ranks
itself; a --tp-size the launch or the machine cannot give is one line naming the flag."""
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
    args = ["--model-path", str(path), "--device", "cpu", "--dtype", "float32", "--prompt", "hello world how many",
            "--max-new-tokens", "24", "--speculative-algorithm", "DDTREE", "--speculative-draft-model-path", str(drafter)]
    single = generate([*args, "--tp-size", "1"], [sys.executable])
    assert single.returncode == 0, single.stderr
    split = generate([*args, "--tp-size", "2"],
                     [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"])
    assert split.returncode == 0, split.stderr
    assert split.stdout == single.stdout and single.stdout.strip()
    assert split.stderr.count("tok/s") == 1  # rank 0 alone reports


def test_tp2_starts_its_own_ranks_and_prints_what_torchrun_prints(tmp_path) -> None:
    """Without a launcher, `generate --tp-size 2` starts its two ranks itself: the same output as under torchrun."""
    path = save_tiny_chat_model(tmp_path)
    args = ["--model-path", str(path), "--device", "cpu", "--dtype", "float32", "--prompt", "hello world",
            "--max-new-tokens", "12"]
    single = generate([*args, "--tp-size", "1"], [sys.executable])
    own = generate([*args, "--tp-size", "2"], [sys.executable])
    assert own.returncode == 0, own.stderr
    assert own.stdout == single.stdout and single.stdout.strip(), (own.stdout, single.stdout, own.stderr)
    assert own.stderr.count("tok/s") == 1


def test_tp_size_unlike_the_launch_is_one_line_error(capsys, monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "3")  # a launcher started 3 processes
    assert main(["generate", "--prompt", "x", "--device", "cpu", "--tp-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "--tp-size 2 needs 2 processes" in err and "WORLD_SIZE is 3" in err and "Traceback" not in err


def test_tp_size_beyond_the_gpus_is_one_line_error(capsys) -> None:
    import torch

    gpus = torch.cuda.device_count()
    tp = max(2, gpus + 1)
    assert main(["generate", "--prompt", "x", "--device", "cuda", "--tp-size", str(tp)]) == 2
    err = capsys.readouterr().err
    assert f"--tp-size {tp} needs {tp} GPUs, this machine has {gpus}" in err and "Traceback" not in err


def test_expert_parallel_tp2_prints_what_tp1_prints(tmp_path) -> None:
    """`--ep-size 2` on a mixture-of-experts target: each rank holds half the experts whole, same text."""
    path = save_tiny_chat_model(tmp_path, "qwen3_5_moe_text")
    args = ["--model-path", str(path), "--device", "cpu", "--dtype", "float32", "--prompt", "hello world",
            "--max-new-tokens", "12"]
    single = generate([*args, "--tp-size", "1"], [sys.executable])
    experts = generate([*args, "--tp-size", "2", "--ep-size", "2"], [sys.executable])
    assert experts.returncode == 0, experts.stderr
    assert experts.stdout == single.stdout and single.stdout.strip(), (experts.stdout, single.stdout)


def test_ep_size_unlike_the_tp_size_is_one_line_error(capsys) -> None:
    """Refused once, before any rank starts (at --tp-size 2 the command would start two)."""
    for flags, tp in ((["--ep-size", "2"], 1), (["--tp-size", "2", "--ep-size", "3"], 2)):
        assert main(["generate", "--prompt", "x", "--device", "cpu", *flags]) == 2
        err = capsys.readouterr().err
        assert err.count(f"--ep-size must be 1 or equal to --tp-size ({tp})") == 1 and "Traceback" not in err
