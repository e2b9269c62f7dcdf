"""Launch flags: the original flag set is accepted, inapplicable flags are logged, impossible ones rejected."""
from __future__ import annotations

import logging

import pytest

from dflash_tfm.launch_server import main
from dflash_tfm.server.args import DEFAULT_MAX_ADMITTED, ServerArgs, parse_server_args

ORIGINAL_FLAGS = [
    "--model-path", "/models/Qwen3.6-27B", "--dtype", "bfloat16", "--tp-size", "1", "--max-running-requests", "4",
    "--cuda-graph-max-bs", "8", "--mem-fraction-static", "0.85", "--page-size", "64", "--disable-radix-cache",
    "--attention-backend", "fa3", "--decode-attention-backend", "flashinfer", "--prefill-attention-backend", "fa3",
    "--speculative-draft-attention-backend", "fa3", "--speculative-algorithm", "DFLASH_TFM",
    "--speculative-draft-model-path", "/models/dflash", "--speculative-dflash-block-size", "16",
    "--speculative-num-draft-tokens", "16", "--speculative-dflash-tfm-path", "/models/weaver.pth",
    "--speculative-dflash-tfm-tree-budget", "64", "--speculative-gdn-verify-kernel", "recurrent",
    "--disable-overlap-schedule", "--host", "0.0.0.0", "--port", "30001",
]


def rejected(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one error line printed when `argv` is refused (argparse style: exit status 2)."""
    with pytest.raises(SystemExit) as e:
        parse_server_args(argv)
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_original_flags_accepted_and_inapplicable_ones_logged(caplog: pytest.LogCaptureFixture) -> None:
    from dflash_tfm.server.args import log_start_warnings

    args = parse_server_args(ORIGINAL_FLAGS, environ={})
    assert (args.model_path, args.dtype, args.host, args.port) == ("/models/Qwen3.6-27B", "bfloat16", "0.0.0.0", 30001)
    spec = args.speculative
    assert spec.algorithm == "DFLASH_TFM" and (spec.block_size, spec.tree_budget) == (16, 64)
    assert spec.gdn_verify_kernel == "recurrent" and str(spec.weaver_path) == "/models/weaver.pth"
    assert args.max_admitted_requests == 4 * 16
    with caplog.at_level(logging.WARNING, logger="dflash_tfm.server"):
        log_start_warnings(args)
    logged = caplog.text
    for flag in ("--cuda-graph-max-bs=8", "--mem-fraction-static=0.85", "--page-size=64", "--disable-radix-cache",
                 "--attention-backend=fa3", "--decode-attention-backend=flashinfer", "--prefill-attention-backend=fa3",
                 "--speculative-draft-attention-backend=fa3", "--disable-overlap-schedule"):
        assert f"{flag} accepted but not applicable" in logged, flag
    assert "--tp-size" not in logged and "--model-path" not in logged  # applicable flags are not flagged
    assert args.max_running_requests == 4  # a fixed tree budget: speculative decoding is batched
    assert "serving on 0.0.0.0 without an API key" in logged  # bound beyond loopback with no key


def test_defaults_are_autoregressive_and_quiet() -> None:
    args = parse_server_args([], environ={})
    assert args == ServerArgs()
    assert not args.speculative.enabled and args.not_applicable == {}
    assert args.max_admitted_requests == DEFAULT_MAX_ADMITTED
    assert parse_server_args(["--speculative-algorithm", "none"], environ={}).speculative.algorithm is None


def test_admission_bound_flags() -> None:
    assert parse_server_args(["--max-running-requests", "1"]).max_admitted_requests == 16
    assert parse_server_args([]).max_running_requests == 8  # continuous batching by default
    four = parse_server_args(["--max-running-requests", "4"])
    assert four.max_running_requests == 4 and four.not_applicable == {}
    spec = parse_server_args(["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", "/d",
                              "--max-running-requests", "4"])
    assert spec.max_running_requests == 4 and spec.not_applicable == {}  # budget auto: one per batch bucket
    fixed = parse_server_args(["--speculative-algorithm", "DDTREE", "--speculative-draft-model-path", "/d",
                               "--speculative-tree-budget", "16", "--max-running-requests", "4"])
    assert fixed.max_running_requests == 4 and fixed.not_applicable == {}  # batched speculative decoding
    alone = parse_server_args(["--speculative-algorithm", "DDTREE", "--speculative-draft-model-path", "/d",
                               "--speculative-tree-budget", "16"])
    assert alone.max_running_requests == 1  # asked for explicitly only: a lone client decodes faster at batch 1
    assert parse_server_args(["--max-running-requests", "1", "--max-queued-requests", "3"]).max_admitted_requests == 3


def test_num_draft_tokens_alone_sets_block_size() -> None:
    args = parse_server_args(["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", "/d",
                              "--speculative-num-draft-tokens", "8"])
    assert args.speculative.block_size == 8
    assert args.speculative.describe()["speculative_tree_budget"] == "auto"  # the chain's length adapts


def test_embedded_target_takes_the_bundle_like_generate() -> None:
    """With the embedded default target, an algorithm alone uses the bundle trained for it (as `dflash-tfm
    generate` does); a user's target still needs its checkpoints named."""
    from dflash_tfm.loading.default_model import DEFAULT_BUNDLE

    spec = parse_server_args(["--speculative-algorithm", "DFLASH_TFM"]).speculative
    assert (spec.draft_model_path, spec.weaver_path) == (DEFAULT_BUNDLE / "dflash", DEFAULT_BUNDLE / "weaver.pth")
    assert parse_server_args(["--speculative-algorithm", "DDTREE"]).speculative.weaver_path is None


def test_security_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    from dflash_tfm.server.guard import LOOPBACK_HOSTS

    args = parse_server_args(["--api-key", "k1"], environ={"DFLASH_TFM_API_KEY": "k2"})
    assert args.api_key == "k1" and "k1" not in repr(args)  # the flag wins; the key never shows in a repr
    assert parse_server_args([], environ={"DFLASH_TFM_API_KEY": "k2"}).api_key == "k2"
    assert parse_server_args([], environ={}).allowed_hosts == LOOPBACK_HOSTS
    assert parse_server_args(["--host", "0.0.0.0"], environ={}).allowed_hosts is None
    assert parse_server_args(["--allowed-hosts", "Example.com", "[::1]"]).allowed_hosts == {"example.com", "::1"}
    assert parse_server_args(["--allowed-hosts", "*"]).allowed_hosts is None
    assert parse_server_args(["--max-request-bytes", "1000"]).max_request_bytes == 1000


DFLASH = ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", "/d"]


@pytest.mark.parametrize("argv,message", [
    (["--revision", "main"], "--revision is not supported"),
    (DFLASH + ["--speculative-draft-model-revision", "abc"], "--speculative-draft-model-revision is not supported"),
    (DFLASH + ["--speculative-num-draft-tokens", "8", "--speculative-dflash-block-size", "16"],
     "--speculative-num-draft-tokens 8 differs from --speculative-dflash-block-size 16"),
    (["--speculative-dflash-tfm-tree-budget", "32"], "--speculative-tree-budget given without --speculative-algorithm"),
    (["--speculative-draft-model-path", "/d", "--speculative-num-draft-tokens", "16"],
     "--speculative-draft-model-path, --speculative-num-draft-tokens given without --speculative-algorithm"),
    (["--speculative-algorithm", "DDTREE", "--speculative-draft-model-path", "/d",
      "--speculative-dflash-tfm-tree-budget", "0"], "(--speculative-tree-budget) must be an integer >= 1 or 'auto', got 0"),
    (DFLASH + ["--speculative-dflash-block-size", "1"], "(--speculative-dflash-block-size) must be >= 2"),
    (["--speculative-dflash-tfm-children-per-node", "8"],
     "--speculative-dflash-tfm-children-per-node given without --speculative-algorithm"),
    (DFLASH[:1] + ["DFLASH_TFM"] + DFLASH[2:] + ["--speculative-dflash-tfm-path", "/w",
      "--speculative-dflash-tfm-children-per-node", "0"], "(--speculative-dflash-tfm-children-per-node) must be an integer >= 1, got 0"),
    (["--speculative-algorithm", "EAGLE"], "invalid choice: 'EAGLE'"),
    (["--model-path", "/m", "--speculative-algorithm", "DFLASH"], "needs draft_model_path (--speculative-draft-model-path)"),
    (["--model-path", "/m"] + DFLASH[:1] + ["DFLASH_TFM"] + DFLASH[2:], "needs weaver_path (--speculative-dflash-tfm-path)"),
    (DFLASH[:1] + ["DDTREE"] + DFLASH[2:] + ["--speculative-dflash-tfm-path", "/w"], "only used by DFLASH_TFM"),
    (["--max-running-requests", "0"], "--max-running-requests must be >= 1"),
    (["--port", "70000"], "--port must be in [0, 65535]"),
    (["--max-request-bytes", "0"], "--max-request-bytes must be >= 1"),
    (["--api-key", " "], "--api-key must not be empty"),
    (["--page-size", "big"], "invalid int value: 'big'"),
])
def test_impossible_flags_rejected_at_start(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    line = rejected(argv, capsys)
    assert "error:" in line and message in line, line


def test_tree_budget_with_chain_algorithm_is_logged_not_used() -> None:
    args = parse_server_args(DFLASH + ["--speculative-dflash-tfm-tree-budget", "32"])
    assert "--speculative-tree-budget=32" in args.not_applicable


def test_weaver_tree_width_flag() -> None:
    """DFLASH_TFM's children per node: default 16, settable (8 = the published width), reported by
    /get_model_info, and logged as unused for the algorithms without a Weaver tree."""
    tfm = DFLASH[:1] + ["DFLASH_TFM"] + DFLASH[2:] + ["--speculative-dflash-tfm-path", "/w"]
    assert parse_server_args(tfm).speculative.children_per_node == 16
    args = parse_server_args(tfm + ["--speculative-dflash-tfm-children-per-node", "8"])
    assert args.speculative.children_per_node == 8
    assert args.speculative.describe()["speculative_dflash_tfm_children_per_node"] == 8
    ddtree = parse_server_args(DFLASH[:1] + ["DDTREE"] + DFLASH[2:] + ["--speculative-dflash-tfm-children-per-node", "8"])
    assert "--speculative-dflash-tfm-children-per-node=8" in ddtree.not_applicable
    assert ddtree.speculative.describe()["speculative_dflash_tfm_children_per_node"] is None


def test_main_reports_load_error_without_serving(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model-path", str(tmp_path / "missing"), "--device", "cpu", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "launch_server: error:" in err and "missing" in err and "Traceback" not in err
