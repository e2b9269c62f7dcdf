"""Launch flags of `python -m dflash_tfm.launch_server`: the original system's flag set, validated once at start.

Flags of the original that mean nothing for a batch-1 single-GPU engine (paging, radix cache, attention
backends, overlap schedule, ...) are accepted so published launch commands run unchanged, and each one the
user gave is reported by `log_not_applicable` — never silently reinterpreted. Combinations that cannot work
(tensor parallelism, a hub revision, speculative flags without an algorithm, ...) fail at start with one
clear message instead of surfacing later as a wrong configuration.
"""
from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field

from dflash_tfm.cli import add_engine_args

logger = logging.getLogger("dflash_tfm.server")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 30000
DEFAULT_MAX_ADMITTED = 256
QUEUE_PER_RUNNING_SLOT = 16  # admitted = 16 x --max-running-requests when --max-queued-requests is not given

# Speculative flags whose presence (not just value) matters: without an algorithm they would be ignored.
SPEC_VALUE_DESTS = ("speculative_dflash_tfm_tree_budget", "speculative_dflash_tfm_children_per_node",
                    "speculative_dflash_block_size", "speculative_gdn_verify_kernel")
SPEC_DESTS = SPEC_VALUE_DESTS + (
    "speculative_draft_model_path", "speculative_dflash_tfm_path", "speculative_num_draft_tokens",
    "speculative_draft_model_revision", "speculative_draft_attention_backend",
)

# Accepted for compatibility; the reason is what the log line says when the user gives the flag.
NOT_APPLICABLE = {
    "cuda_graph_max_bs": "the engine is batch 1 and captures only the bs=1 decode graph (--disable-cuda-graph turns it off)",
    "mem_fraction_static": "caches are static and sized by --max-model-len, not by a memory fraction",
    "page_size": "the KV cache is one contiguous static buffer, not paged",
    "disable_radix_cache": "there is no prefix cache: every request is prefilled in full (as if disabled)",
    "attention_backend": "the engine picks its own kernels (SDPA, Triton tree attention, fla for GDN)",
    "decode_attention_backend": "the engine picks its own kernels (SDPA, Triton tree attention, fla for GDN)",
    "prefill_attention_backend": "the engine picks its own kernels (SDPA, Triton tree attention, fla for GDN)",
    "speculative_draft_attention_backend": "the drafter uses the engine's own attention kernels",
    "disable_overlap_schedule": "there is no overlap scheduler: one request runs at a time, step by step",
}


class ServerArgsError(ValueError):
    """An impossible flag or flag combination; the message says which and why."""


@dataclass
class ServerArgs:
    """Validated launch settings: engine settings (as `cli.engine_from_args` reads them) + server settings."""

    model_path: str | None = None
    dtype: str = "auto"
    device: str | None = None
    max_model_len: int | None = None
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    speculative_dflash_tfm_path: str | None = None
    speculative_dflash_tfm_tree_budget: int = 64
    speculative_dflash_tfm_children_per_node: int = 16
    speculative_dflash_block_size: int | None = None  # None: the drafter's own block size
    speculative_gdn_verify_kernel: str = "chunk"
    disable_cuda_graph: bool = False
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    served_model_name: str | None = None
    max_admitted_requests: int = DEFAULT_MAX_ADMITTED
    log_level: str = "info"
    not_applicable: dict[str, str] = field(default_factory=dict)  # flag as typed -> why it is not used

    def engine_namespace(self) -> argparse.Namespace:
        """The namespace `dflash_tfm.cli.engine_from_args` builds the Engine from."""
        return argparse.Namespace(**{k: v for k, v in vars(self).items() if k not in _SERVER_ONLY})

    def speculative_info(self) -> dict[str, object]:
        """Speculative settings as reported by /get_model_info (empty values when decoding is autoregressive)."""
        spec = self.speculative_algorithm is not None
        return {
            "speculative_algorithm": self.speculative_algorithm,
            "speculative_draft_model_path": self.speculative_draft_model_path,
            "speculative_dflash_tfm_path": self.speculative_dflash_tfm_path,
            "speculative_dflash_block_size": self.speculative_dflash_block_size if spec else None,
            "speculative_dflash_tfm_tree_budget": (
                self.speculative_dflash_tfm_tree_budget if self.speculative_algorithm in ("DDTREE", "DFLASH_TFM") else None
            ),
            "speculative_dflash_tfm_children_per_node": (
                self.speculative_dflash_tfm_children_per_node if self.speculative_algorithm == "DFLASH_TFM" else None
            ),
            "speculative_gdn_verify_kernel": self.speculative_gdn_verify_kernel if spec else None,
        }


_SERVER_ONLY = {"host", "port", "served_model_name", "max_admitted_requests", "log_level", "not_applicable"}


def _engine_flag_defaults() -> dict[str, object]:
    """Defaults of the shared engine flags, read from cli.py so they are defined in one place."""
    p = argparse.ArgumentParser(add_help=False)
    add_engine_args(p)
    return vars(p.parse_args([]))


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dflash_tfm.launch_server",
        usage="%(prog)s [--model-path PATH] [--speculative-algorithm ALGO ...] [--host HOST] [--port PORT] (see --help)",
        description="OpenAI-compatible + /generate HTTP server for one dflash-tfm engine (batch 1).",
    )
    add_engine_args(p)
    # None = "not given", so a speculative value flag without an algorithm can be told apart from its default.
    p.set_defaults(**{dest: None for dest in SPEC_VALUE_DESTS})
    p.add_argument("--revision", default=None, help="rejected: weights are local paths only (no hub downloads)")
    p.add_argument("--speculative-draft-model-revision", default=None, help="rejected: local paths only")
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                   help="draft tokens per step; must equal --speculative-dflash-block-size (sets it when given alone)")
    p.add_argument("--tp-size", type=int, default=1, help="tensor parallelism: only 1 is supported (one GPU)")
    p.add_argument("--max-running-requests", type=int, default=None,
                   help="requests decoded at once; the engine runs 1, so this sizes admission: "
                        f"{QUEUE_PER_RUNNING_SLOT} x N requests may be admitted (running + waiting)")
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="requests admitted at once (running + waiting, FIFO); more get HTTP 503 "
                        f"(default {QUEUE_PER_RUNNING_SLOT} x --max-running-requests, else {DEFAULT_MAX_ADMITTED})")
    p.add_argument("--cuda-graph-max-bs", type=int, default=None)
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--page-size", type=int, default=None)
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--decode-attention-backend", default=None)
    p.add_argument("--prefill-attention-backend", default=None)
    p.add_argument("--speculative-draft-attention-backend", default=None)
    p.add_argument("--disable-overlap-schedule", action="store_true")
    p.add_argument("--served-model-name", default=None, help="model id in /v1/models and responses (default: model path)")
    p.add_argument("--host", default=DEFAULT_HOST)
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return p


def server_args_from_namespace(ns: argparse.Namespace) -> ServerArgs:
    """Check a parsed namespace and resolve defaults; raises ServerArgsError naming the offending flags."""
    if ns.tp_size != 1:
        raise ServerArgsError(f"--tp-size {ns.tp_size} is not supported: the engine runs on one GPU (use --tp-size 1)")
    for dest in ("revision", "speculative_draft_model_revision"):
        if getattr(ns, dest) is not None:
            raise ServerArgsError(
                f"{_flag(dest)} is not supported: nothing is downloaded, pass a local path to the checkpoint instead"
            )
    algo = None if ns.speculative_algorithm in (None, "NONE") else ns.speculative_algorithm
    given_spec = [_flag(d) for d in SPEC_DESTS if getattr(ns, d) is not None]
    if algo is None and given_spec:
        raise ServerArgsError(f"{', '.join(given_spec)} given without --speculative-algorithm (DFLASH, DDTREE or DFLASH_TFM)")

    defaults = _engine_flag_defaults()
    block = ns.speculative_dflash_block_size
    if ns.speculative_num_draft_tokens is not None:
        if block is not None and block != ns.speculative_num_draft_tokens:
            raise ServerArgsError(
                f"--speculative-num-draft-tokens {ns.speculative_num_draft_tokens} differs from "
                f"--speculative-dflash-block-size {block}: a DFlash step drafts one block, give one value"
            )
        block = ns.speculative_num_draft_tokens
    block = defaults["speculative_dflash_block_size"] if block is None else block  # None: the drafter's own
    budget = ns.speculative_dflash_tfm_tree_budget
    if block is not None and block < 2:
        raise ServerArgsError(f"--speculative-dflash-block-size must be >= 2 (root + at least one draft), got {block}")
    if budget is not None and budget < 1:
        raise ServerArgsError(f"--speculative-dflash-tfm-tree-budget must be >= 1, got {budget}")
    children = ns.speculative_dflash_tfm_children_per_node
    if children is not None and children < 1:
        raise ServerArgsError(f"--speculative-dflash-tfm-children-per-node must be >= 1, got {children}")
    if algo is not None and ns.speculative_draft_model_path is None:
        raise ServerArgsError(f"--speculative-algorithm {algo} needs --speculative-draft-model-path (the DFlash drafter)")
    if algo == "DFLASH_TFM" and ns.speculative_dflash_tfm_path is None:
        raise ServerArgsError("--speculative-algorithm DFLASH_TFM needs --speculative-dflash-tfm-path (the Weaver checkpoint)")
    if algo in ("DFLASH", "DDTREE") and ns.speculative_dflash_tfm_path is not None:
        raise ServerArgsError(
            f"--speculative-dflash-tfm-path (Weaver) is only used by DFLASH_TFM, not {algo}; "
            "drop it or use --speculative-algorithm DFLASH_TFM"
        )
    for dest, lo in (("max_running_requests", 1), ("max_queued_requests", 1), ("max_model_len", 2)):
        value = getattr(ns, dest)
        if value is not None and value < lo:
            raise ServerArgsError(f"{_flag(dest)} must be >= {lo}, got {value}")
    if not 0 <= ns.port <= 65535:
        raise ServerArgsError(f"--port must be in [0, 65535], got {ns.port}")

    not_applicable = {
        _flag(dest) if getattr(ns, dest) is True else f"{_flag(dest)}={getattr(ns, dest)}": why
        for dest, why in NOT_APPLICABLE.items() if getattr(ns, dest) not in (None, False)
    }
    if ns.max_running_requests is not None and ns.max_running_requests > 1:
        not_applicable[f"--max-running-requests={ns.max_running_requests}"] = (
            "the engine decodes 1 request at a time (batch 1); others wait in a FIFO queue"
        )
    if algo == "DFLASH" and budget is not None:
        not_applicable[f"--speculative-dflash-tfm-tree-budget={budget}"] = "DFLASH verifies a chain, not a tree"
    if algo in ("DFLASH", "DDTREE") and children is not None:
        not_applicable[f"--speculative-dflash-tfm-children-per-node={children}"] = f"{algo} grows no Weaver tree"
    if ns.max_queued_requests is not None:
        admitted = ns.max_queued_requests
    elif ns.max_running_requests is not None:
        admitted = QUEUE_PER_RUNNING_SLOT * ns.max_running_requests
    else:
        admitted = DEFAULT_MAX_ADMITTED
    return ServerArgs(
        model_path=ns.model_path, dtype=ns.dtype, device=ns.device, max_model_len=ns.max_model_len,
        speculative_algorithm=algo,
        speculative_draft_model_path=ns.speculative_draft_model_path,
        speculative_dflash_tfm_path=ns.speculative_dflash_tfm_path,
        speculative_dflash_tfm_tree_budget=defaults["speculative_dflash_tfm_tree_budget"] if budget is None else budget,
        speculative_dflash_tfm_children_per_node=(
            defaults["speculative_dflash_tfm_children_per_node"] if children is None else children),
        speculative_dflash_block_size=block,
        speculative_gdn_verify_kernel=ns.speculative_gdn_verify_kernel or defaults["speculative_gdn_verify_kernel"],
        disable_cuda_graph=ns.disable_cuda_graph,
        host=ns.host, port=ns.port, served_model_name=ns.served_model_name,
        max_admitted_requests=admitted, log_level=ns.log_level, not_applicable=not_applicable,
    )


def parse_server_args(argv: list[str] | None = None) -> ServerArgs:
    """Parse and validate launch flags; a bad flag exits with status 2 and one `error:` line (argparse style)."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        return server_args_from_namespace(ns)
    except ServerArgsError as e:
        parser.error(str(e))


def log_not_applicable(args: ServerArgs) -> None:
    """One warning per accepted flag that this engine does not use, so nobody believes it took effect."""
    for flag, why in args.not_applicable.items():
        logger.warning("%s accepted but not applicable: %s", flag, why)
