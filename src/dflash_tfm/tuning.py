"""Kernel choices that depend on the GPU and the shape, timed once per GPU model and kept in a JSON file.

Most operators have one implementation, fixed in code from the recorded H200 sweeps (docs/PERFORMANCE.md). A few
have a winner that truly changes with the shape: which kernel streams a projection's weight fastest for 1, 16 or
65 rows, how many cache splits the verify attention wants for 16 or 65 tree nodes, which row tile the Weaver's
fused projections take. For those a `TunedChoice` times its candidates on the caller's real tensors, but only
once per GPU model: the result goes into a file that every later process reads, so two runs of the same command
take the same kernels. (Timing anew in every process let the choice flip between runs when two candidates came
within noise of each other: one flipped add + norm choice cost 0.37 ms per decode step; docs/PERFORMANCE.md,
autoregressive decode step.)

The file. ``<cache>/tuning/<gpu-name-slug>.json`` (e.g. ``nvidia-h200.json``), where ``<cache>`` is
``$DFLASH_TFM_CACHE`` or ``~/.cache/dflash_tfm`` (the same directory as the GGUF tokenizer cache). One file per GPU
model, like Triton's autotune cache or vLLM's tuned MoE configs: a choice made on an H200 does not say what an
H100 wants. Format::

    {"format": 1, "device": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0",
     "choices": {"projection": {"65,34816,5120,bfloat16,bfloat16": {"chosen": "cublas/2",
                                                                   "ms": {"cublas": 0.0973, "cublas/2": 0.0935}}}}}

keyed by operator, then by the operator's shape key (its key tuple as comma-joined text, dtypes without the
``torch.`` prefix); each entry keeps every candidate's time (and why a candidate failed), so a report shows by
how much the others lost. ``dflash-tfm tune`` re-times every choice of a target's shapes and rewrites their
entries; deleting the file starts it over.

A key missing from the file is timed at its first use, as before: outside a CUDA-graph capture (the engine runs
every phase eagerly before capturing it), each candidate replayed from a CUDA graph (`do_bench_cudagraph`: timed
eagerly, a candidate of several launches pays Python launch overhead a graph does not), and a candidate must
beat the default by `MIN_GAIN`, so kernels that are equally fast keep the default. The result is merged into the
file under a lock and written through a temporary file and ``os.replace``, so concurrent processes never read
half a file; if another process recorded the key first, its choice is taken, so they agree. Inside a capture,
or on tensors that are not on CUDA, nothing is timed or written: the default runs (on the CPU that is the torch
twin or the plain op, as always).
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import re
import tempfile
from collections import Counter
from pathlib import Path
from typing import Callable, Hashable, Iterator

import torch

MIN_GAIN = 0.02  # a candidate replaces the default only when at least 2 % faster
FORMAT = 1
log = logging.getLogger(__name__)

Candidates = Callable[[], dict[str, Callable[[], object]]]


def cache_dir() -> Path:
    """Where the per-GPU files live (`use_directory` overrides it, e.g. for tests)."""
    if _directory is not None:
        return _directory
    return Path(os.environ.get("DFLASH_TFM_CACHE", Path.home() / ".cache" / "dflash_tfm")) / "tuning"


def use_directory(path: str | Path | None) -> None:
    """Keep the files under ``path`` instead (None: back to `cache_dir`'s default); forgets loaded tables."""
    global _directory
    _directory = None if path is None else Path(path)
    _tables.clear()


def device_slug(name: str) -> str:
    """"NVIDIA H200" -> "nvidia-h200": the file name of a GPU model."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def key_text(key: Hashable) -> str:
    """A shape key as the file writes it: the tuple's items comma-joined, dtypes without ``torch.``."""
    items = key if isinstance(key, tuple) else (key,)
    return ",".join(str(x).removeprefix("torch.") for x in items)


class Table:
    """The choices of one GPU model: what its file holds plus what this process timed since."""

    def __init__(self, device_name: str, path: Path, fresh: bool = False) -> None:
        self.device_name, self.path, self.fresh = device_name, path, fresh
        self.choices: dict[str, dict[str, dict]] = {} if fresh else _read(path, device_name)
        self.picked: dict[tuple[str, Hashable], str] = {}  # (operator, key tuple) -> name, the per-call lookup
        self._write_failed = False

    def get(self, operator: str, key: str) -> dict | None:
        return self.choices.get(operator, {}).get(key)

    def record(self, operator: str, key: str, entry: dict, candidates: tuple[str, ...]) -> str:
        """Keep ``entry`` for (operator, key) here and in the file; returns the choice that stands (another
        process's, if it wrote the key first with one of ``candidates``). A fresh table (`retuning`) is only
        written by `save`."""
        if not self.fresh:
            try:
                with _locked(self.path):
                    on_disk = _read(self.path, self.device_name)
                    found = on_disk.get(operator, {}).get(key)
                    entry = found if found is not None and found.get("chosen") in candidates else entry
                    on_disk.setdefault(operator, {})[key] = entry
                    _write(self.path, self.device_name, on_disk)
                    for op, entries in on_disk.items():  # what other processes recorded meanwhile
                        self.choices.setdefault(op, {}).update(entries)
            except OSError as e:
                if not self._write_failed:
                    log.warning("cannot write the tuning cache %s (%s): choices are kept for this process only",
                                self.path, e)
                self._write_failed = True
        self.choices.setdefault(operator, {})[key] = entry
        return entry["chosen"]

    def save(self) -> None:
        """Write this table's entries into the file (over the file's own for the same keys; other keys stay)."""
        with _locked(self.path):
            on_disk = _read(self.path, self.device_name)
            for op, entries in self.choices.items():
                on_disk.setdefault(op, {}).update(entries)
            _write(self.path, self.device_name, on_disk)

    def digest(self) -> str:
        """A short hash of every (operator, key, choice): two processes with equal digests take the same path."""
        chosen = {op: {k: e["chosen"] for k, e in entries.items()} for op, entries in self.choices.items()}
        return hashlib.sha1(json.dumps(chosen, sort_keys=True).encode()).hexdigest()[:8]


class TunedChoice:
    """One operator whose fastest implementation depends on the GPU and the shape (see the module docstring).

    ``candidates`` names every implementation the operator can take (a name from the file that is not one of
    them, e.g. after an update, is timed anew); ``default`` runs wherever nothing is timed and must work
    everywhere. `pick` is called on every use with the candidates' builder, which runs only when timing."""

    def __init__(self, operator: str, default: str, candidates: tuple[str, ...]) -> None:
        if default not in candidates:
            raise ValueError(f"{operator}: default {default!r} is not one of {candidates}")
        if operator in _registry:
            raise ValueError(f"a tuned choice named {operator!r} exists already")
        self.operator, self.default, self.candidates = operator, default, candidates
        self._forced: str | None = None
        _registry[operator] = self

    def pick(self, key: Hashable, candidates: Candidates, device: torch.device) -> str:
        """The name to run for ``key`` on ``device``: forced (`forced`), else from the GPU's table, else timed
        now and recorded; the default on a CPU or during a CUDA-graph capture."""
        if self._forced is not None:
            return self._forced
        if device.type != "cuda":
            return self.default
        table = _table(device)
        chosen = table.picked.get((self.operator, key))
        if chosen is not None:
            return chosen
        text = key_text(key)
        entry = table.get(self.operator, text)
        if entry is not None and entry.get("chosen") in self.candidates:
            chosen = entry["chosen"]
        elif torch.cuda.is_current_stream_capturing():
            return self.default
        else:
            entry = self._time(candidates())
            chosen = table.record(self.operator, text, entry, self.candidates)
            log.info("%s on %s, %s: %s", self.operator, table.device_name, text, describe_entry(entry, self.default))
        table.picked[(self.operator, key)] = chosen
        return chosen

    def _time(self, candidates: dict[str, Callable[[], object]]) -> dict:
        from triton.testing import do_bench_cudagraph

        # do_bench_cudagraph runs the candidates on a stream of its own, which does not wait for the caller's:
        # without this the candidates could read inputs the caller's stream has not written yet (an illegal
        # address when one of them is a length or an index)
        torch.cuda.synchronize()
        times, failed = {}, {}
        for name, fn in candidates.items():
            try:
                times[name] = do_bench_cudagraph(fn, rep=20, return_mode="median")
            except Exception as e:  # noqa: BLE001 — any failure just disqualifies the candidate
                if name == self.default:
                    raise
                failed[name] = f"{type(e).__name__}: {e}"[:300]
        best = min(times, key=times.get)
        chosen = best if times[best] < (1 - MIN_GAIN) * times[self.default] else self.default
        ms = {name: round(t, 4) for name, t in times.items()}
        return {"chosen": chosen, "ms": ms} | ({"failed": failed} if failed else {})

    @contextlib.contextmanager
    def forced(self, name: str) -> Iterator[None]:
        """Every pick inside the block returns ``name`` (on any device, nothing timed): tests of one path."""
        if name not in self.candidates:
            raise ValueError(f"{self.operator}: {name!r} is not one of {self.candidates}")
        previous, self._forced = self._forced, name
        try:
            yield
        finally:
            self._forced = previous


def describe_entry(entry: dict, default: str) -> str:
    """"chosen 0.0935 ms (default cublas 0.0973 ms)", or the runner-up when the default stood; failures named."""
    times, chosen = entry["ms"], entry["chosen"]
    runner_up = min((n for n in times if n != chosen), key=times.get, default=None)
    text = f"{chosen} {times[chosen]:.4f} ms"
    if chosen != default:
        text += f" (default {default} {times[default]:.4f} ms)"
    elif runner_up is not None:
        text += f" (best other {runner_up} {times[runner_up]:.4f} ms)"
    if entry.get("failed"):
        text += f"; failed: {', '.join(entry['failed'])}"
    return text


def report(device: torch.device) -> dict[str, dict[str, dict]]:
    """Every operator's entries on ``device``'s GPU (chosen, every candidate's ms, failures): what benchmarks keep."""
    return {op: dict(entries) for op, entries in _table(device).choices.items()} if device.type == "cuda" else {}


def describe(device: torch.device) -> list[str]:
    """One line per tuned shape on ``device``'s GPU: the choice against the default or the runner-up."""
    lines = []
    for op, entries in report(device).items():
        default = _registry[op].default if op in _registry else ""
        lines += [f"{op} {key}: {describe_entry(entry, default)}" for key, entry in entries.items()]
    return lines


def describe_kernel_path(device: torch.device) -> str:
    """One line for a process's start: the tuning file in use and, per tuned operator, how many shapes take each
    implementation (operators without a line in the file time theirs at first use). On a CPU: the torch twins."""
    if device.type != "cuda":
        return f"kernel path on {device.type}: torch twins and plain ops (nothing is tuned off CUDA)"
    table = _table(device)
    parts = []
    for op in sorted(set(_registry) | set(table.choices)):
        counts = Counter(e["chosen"] for e in table.choices.get(op, {}).values())
        parts.append(f"{op} " + (", ".join(f"{n} x{c}" for n, c in sorted(counts.items())) or "untuned"))
    state = "read" if table.path.exists() else "new"
    return (f"kernel path on {table.device_name}: tuning cache {table.path} ({state}, table {table.digest()}); "
            + "; ".join(parts))


@contextlib.contextmanager
def retuning(device: torch.device) -> Iterator[Table]:
    """Inside the block every choice on ``device``'s GPU is timed anew (the file is not read); at the end what was
    timed is written over the file's entries for those shapes (other shapes' stay: delete the file to drop them).
    `dflash-tfm tune` runs a target's steps inside it."""
    name = _device_name(device.index if device.index is not None else torch.cuda.current_device())
    table = Table(name, cache_dir() / f"{device_slug(name)}.json", fresh=True)
    _tables[name] = table
    try:
        yield table
    finally:
        del _tables[name]
    table.fresh = False
    table.save()


def _table(device: torch.device) -> Table:
    name = _device_name(device.index if device.index is not None else torch.cuda.current_device())
    if name not in _tables:
        _tables[name] = Table(name, cache_dir() / f"{device_slug(name)}.json")
    return _tables[name]


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def _read(path: Path, device_name: str) -> dict[str, dict[str, dict]]:
    """The file's choices, or none if it is missing, unreadable, of another format or another GPU."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("device") != device_name:
        return {}
    choices = data.get("choices")
    return choices if isinstance(choices, dict) else {}


def _write(path: Path, device_name: str, choices: dict) -> None:
    import triton

    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"format": FORMAT, "device": device_name, "torch": torch.__version__, "triton": triton.__version__,
            "choices": {op: dict(sorted(entries.items())) for op, entries in sorted(choices.items())}}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path``'s sidecar lock file, for a read-merge-write of the file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


_directory: Path | None = None
_tables: dict[str, Table] = {}
_registry: dict[str, TunedChoice] = {}
