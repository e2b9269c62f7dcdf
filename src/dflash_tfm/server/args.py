"""Launch flags of `python -m dflash_tfm.launch_server`: the original system's flag set, validated once at start.

Flags of the original that mean nothing for this single-GPU engine (paging, radix cache, attention backends,
overlap schedule, ...) are accepted so published launch commands run unchanged, and each one the
user gave is reported by `log_start_warnings` — never silently reinterpreted. Combinations that cannot work
(a hub revision, speculative flags without an algorithm, ...) fail at start with one
clear message instead of surfacing later as a wrong configuration.
"""
from __future__ import annotations

import argparse
import ipaddress
import logging
import os
from dataclasses import dataclass, field

from dflash_tfm.engine.args import add_engine_args
from dflash_tfm.loading.default_model import DEFAULT_BUNDLE
from dflash_tfm.server.guard import LOOPBACK_HOSTS, host_name
from dflash_tfm.speculative_config import (SpeculativeConfig, SpeculativeConfigError, speculative_config_from_args,
                                           unused_speculative_flags)

logger = logging.getLogger("dflash_tfm.server")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 30000
DEFAULT_MAX_ADMITTED = 256
DEFAULT_MAX_RUNNING = 8  # requests decoded together by continuous batching (autoregressive decoding)
QUEUE_PER_RUNNING_SLOT = 16  # admitted = 16 x --max-running-requests when --max-queued-requests is not given
DEFAULT_MAX_REQUEST_BYTES = 8 << 20  # a 32k-token prompt is ~150 kB of text or ~250 kB of ids: 8 MiB is ample
DEFAULT_TIMEOUT_READ = 30.0
DEFAULT_TIMEOUT_KEEP_ALIVE = 5
API_KEY_ENV = "DFLASH_TFM_API_KEY"

# Accepted for compatibility; the reason is what the log line says when the user gives the flag.
NOT_APPLICABLE = {
    "cuda_graph_max_bs": "decode graphs are captured per batch bucket up to --max-running-requests (--disable-cuda-graph turns them off)",
    "mem_fraction_static": "caches are static and sized by --max-model-len, not by a memory fraction",
    "page_size": "the KV cache is one contiguous static buffer, not paged",
    "disable_radix_cache": "there is no prefix cache: every request is prefilled in full (as if disabled)",
    "attention_backend": "the engine picks its own kernels (SDPA, Triton tree attention, fla for GDN)",
    "decode_attention_backend": "the engine picks its own kernels (SDPA, Triton tree attention, fla for GDN)",
    "prefill_attention_backend": "the engine picks its own kernels (SDPA, Triton tree attention, fla for GDN)",
    "speculative_draft_attention_backend": "the drafter uses the engine's own attention kernels",
    "disable_overlap_schedule": "there is no overlap scheduler: the host work of a step follows its forward pass",
}


class ServerArgsError(ValueError):
    """An impossible flag or flag combination; the message says which and why."""


@dataclass
class ServerArgs:
    """Validated launch settings: what builds the Engine, then the server's own settings.

    max_running_requests is what the engine decodes together: the flag (default 8) for autoregressive
    decoding; with a speculative algorithm 1 unless the flag asks for more (a lone request then keeps the
    batch-1 decoder's draft-ahead steps; with the flag, its batch's adaptive budget chooses one size per step).

    allowed_hosts None accepts any Host header (the default when bound to a non-loopback address); api_key
    None serves without authentication."""

    model_path: str | None = None
    dtype: str = "auto"
    quantization: str | None = None
    device: str | None = None
    max_model_len: int | None = None
    disable_cuda_graph: bool = False
    tp_size: int = 1
    ep_size: int = 1
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    max_running_requests: int = DEFAULT_MAX_RUNNING
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    served_model_name: str | None = None
    max_admitted_requests: int = DEFAULT_MAX_ADMITTED
    api_key: str | None = field(default=None, repr=False)
    allowed_hosts: frozenset[str] | None = LOOPBACK_HOSTS
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    timeout_read: float = DEFAULT_TIMEOUT_READ
    timeout_keep_alive: int = DEFAULT_TIMEOUT_KEEP_ALIVE
    log_level: str = "info"
    not_applicable: dict[str, str] = field(default_factory=dict)  # flag as typed -> why it is not used


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dflash_tfm.launch_server",
        usage="%(prog)s [--model-path PATH] [--speculative-algorithm ALGO ...] [--host HOST] [--port PORT] (see --help)",
        description="OpenAI-compatible + /generate HTTP server for one dflash-tfm engine.",
    )
    add_engine_args(p)
    p.add_argument("--revision", default=None, help="rejected: weights are local paths only (no hub downloads)")
    p.add_argument("--speculative-draft-model-revision", default=None, help="rejected: local paths only")
    p.add_argument("--max-running-requests", type=int, default=None,
                   help=f"requests decoded together by continuous batching (default {DEFAULT_MAX_RUNNING}; "
                        "with a speculative algorithm 1 unless given); the cache holds one row of --max-model-len "
                        f"tokens per request, and {QUEUE_PER_RUNNING_SLOT} x N requests may be admitted "
                        "(running + waiting) when the flag is given"),
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
    p.add_argument("--served-model-name", default=None,
                   help="model id in /v1/models and responses (default: the model path's last component)")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on every route but /health (or set {API_KEY_ENV})")
    p.add_argument("--allowed-hosts", nargs="+", default=None, metavar="HOST",
                   help="Host header names accepted ('*': any); default: loopback names when bound to loopback, "
                        "else any")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help=f"largest request body accepted (HTTP 413 beyond; default {DEFAULT_MAX_REQUEST_BYTES})")
    p.add_argument("--timeout-read", type=float, default=DEFAULT_TIMEOUT_READ,
                   help="seconds a client may take to send its request headers, and between body chunks "
                        f"(default {DEFAULT_TIMEOUT_READ:g})")
    p.add_argument("--timeout-keep-alive", type=int, default=DEFAULT_TIMEOUT_KEEP_ALIVE,
                   help=f"seconds an idle keep-alive connection stays open (default {DEFAULT_TIMEOUT_KEEP_ALIVE})")
    p.add_argument("--host", default=DEFAULT_HOST)
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return p


def server_args_from_namespace(ns: argparse.Namespace, environ: dict[str, str] | None = None) -> ServerArgs:
    """Check a parsed namespace and resolve defaults; raises ServerArgsError naming the offending flags."""
    environ = os.environ if environ is None else environ
    for dest in ("revision", "speculative_draft_model_revision"):
        if getattr(ns, dest) is not None:
            raise ServerArgsError(
                f"{_flag(dest)} is not supported: nothing is downloaded, pass a local path to the checkpoint instead"
            )
    try:  # the embedded default target uses the bundle trained for it, as `dflash-tfm generate` does
        spec = speculative_config_from_args(ns).with_checkpoints(DEFAULT_BUNDLE if ns.model_path is None else None)
    except SpeculativeConfigError as e:
        raise ServerArgsError(str(e)) from e
    for dest, lo in (("max_running_requests", 1), ("max_queued_requests", 1), ("max_model_len", 2),
                     ("max_request_bytes", 1), ("timeout_read", 0.001), ("timeout_keep_alive", 1)):
        value = getattr(ns, dest)
        if value is not None and value < lo:
            raise ServerArgsError(f"{_flag(dest)} must be >= {lo}, got {value}")
    if not 0 <= ns.port <= 65535:
        raise ServerArgsError(f"--port must be in [0, 65535], got {ns.port}")
    api_key = ns.api_key if ns.api_key is not None else environ.get(API_KEY_ENV) or None
    if api_key is not None:  # surrounding whitespace (a stray newline in an env file) is not part of the key
        api_key = api_key.strip()
        if not api_key:
            raise ServerArgsError("--api-key must not be empty")
    if ns.allowed_hosts is not None:
        allowed = None if "*" in ns.allowed_hosts else frozenset(host_name(h) for h in ns.allowed_hosts)
    else:  # bound to loopback: its own address and the loopback names
        allowed = LOOPBACK_HOSTS | {host_name(ns.host)} if is_loopback(ns.host) else None

    not_applicable = {
        _flag(dest) if getattr(ns, dest) is True else f"{_flag(dest)}={getattr(ns, dest)}": why
        for dest, why in NOT_APPLICABLE.items() if getattr(ns, dest) not in (None, False)
    }
    running = DEFAULT_MAX_RUNNING if ns.max_running_requests is None else ns.max_running_requests
    if spec.enabled and ns.max_running_requests is None:
        running = 1
    not_applicable.update(unused_speculative_flags(ns, spec))
    if ns.max_queued_requests is not None:
        admitted = ns.max_queued_requests
    elif ns.max_running_requests is not None:
        admitted = QUEUE_PER_RUNNING_SLOT * ns.max_running_requests
    else:
        admitted = DEFAULT_MAX_ADMITTED
    return ServerArgs(
        model_path=ns.model_path, dtype=ns.dtype, quantization=ns.quantization, device=ns.device, max_model_len=ns.max_model_len,
        disable_cuda_graph=ns.disable_cuda_graph, tp_size=ns.tp_size, ep_size=ns.ep_size,
        speculative=spec,
        max_running_requests=running, host=ns.host, port=ns.port,
        served_model_name=ns.served_model_name, max_admitted_requests=admitted, api_key=api_key,
        allowed_hosts=allowed, max_request_bytes=ns.max_request_bytes, timeout_read=ns.timeout_read,
        timeout_keep_alive=ns.timeout_keep_alive, log_level=ns.log_level, not_applicable=not_applicable,
    )


def parse_server_args(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> ServerArgs:
    """Parse and validate launch flags; a bad flag exits with status 2 and one `error:` line (argparse style)."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        return server_args_from_namespace(ns, environ)
    except ServerArgsError as e:
        parser.error(str(e))


def log_start_warnings(args: ServerArgs) -> None:
    """One warning per accepted flag that this engine does not use, so nobody believes it took effect, and one
    when the server is reachable from other machines without an API key."""
    for flag, why in args.not_applicable.items():
        logger.warning("%s accepted but not applicable: %s", flag, why)
    if args.api_key is None and not is_loopback(args.host):
        logger.warning("serving on %s without an API key: anyone who can reach this address can use every route; "
                       "set --api-key (or %s)", args.host, API_KEY_ENV)
