"""The tuning cache (`dflash_tfm.tuning`): a choice is timed once per GPU model and shape, written to that GPU's JSON
file, and read back by the next process, which then times nothing; the CPU never times or writes. CUDA is faked:
the device name, the capture state and the timer are replaced, the candidates return their own "times"."""
from __future__ import annotations

import json

import pytest
import torch

from dflash_tfm import tuning

GPU = torch.device("cuda")


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """A fresh cache directory and registry, a GPU named "NVIDIA Test GPU", no capture, and a timer that returns
    what each candidate returns (ms); `timed` lists the candidates timed (marked if timed before a synchronisation
with the caller's stream)."""
    import triton.testing

    timed: list[str] = []
    synchronized = []

    def bench(fn, **kw):  # the candidates run on a stream of their own: the caller's must have finished first
        name, ms = fn()
        timed.append(name if synchronized else f"{name} before the caller's stream finished")
        return ms

    monkeypatch.setattr(tuning, "_registry", {})
    monkeypatch.setattr(tuning, "_device_name", lambda index: "NVIDIA Test GPU")
    monkeypatch.setattr(tuning.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(tuning.torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(tuning.torch.cuda, "synchronize", lambda device=None: synchronized.append(True))
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", bench)
    session_directory = tuning.cache_dir()
    tuning.use_directory(tmp_path)
    yield timed
    tuning.use_directory(session_directory)


def timings(**ms: float):
    """A candidates builder whose candidate ``name`` takes ``ms[name]`` milliseconds."""
    return lambda: {name: (lambda name=name, t=t: (name, t)) for name, t in ms.items()}


def new_process() -> None:
    """What a second process sees: nothing in memory, the file on disk."""
    tuning.use_directory(tuning.cache_dir())


def test_a_choice_is_timed_once_and_the_next_process_reads_it(fake_gpu, tmp_path) -> None:
    choice = tuning.TunedChoice("op", default="a", candidates=("a", "b"))
    assert choice.pick((65, torch.bfloat16), timings(a=2.0, b=1.0), GPU) == "b"
    assert fake_gpu == ["a", "b"]
    assert choice.pick((65, torch.bfloat16), timings(a=2.0, b=9.0), GPU) == "b"  # decided: not timed again
    assert fake_gpu == ["a", "b"]
    data = json.loads((tmp_path / "nvidia-test-gpu.json").read_text())
    assert data["format"] == tuning.FORMAT and data["device"] == "NVIDIA Test GPU"
    assert data["choices"] == {"op": {"65,bfloat16": {"chosen": "b", "ms": {"a": 2.0, "b": 1.0}}}}
    new_process()
    assert choice.pick((65, torch.bfloat16), timings(a=1.0, b=9.0), GPU) == "b"
    assert fake_gpu == ["a", "b"]


def test_the_default_stays_unless_clearly_faster(fake_gpu) -> None:
    choice = tuning.TunedChoice("op", default="a", candidates=("a", "b", "c"))
    assert choice.pick("k1", timings(a=1.0, b=0.99, c=1.5), GPU) == "a"  # 1 % is within noise
    assert choice.pick("k2", timings(a=1.0, b=0.9, c=1.5), GPU) == "b"
    assert tuning.describe(GPU) == ["op k1: a 1.0000 ms (best other b 0.9900 ms)",
                                    "op k2: b 0.9000 ms (default a 1.0000 ms)"]


def test_a_candidate_that_fails_is_left_out(fake_gpu) -> None:
    def broken():
        raise RuntimeError("does not compile here")

    choice = tuning.TunedChoice("op", default="safe", candidates=("safe", "fast"))
    assert choice.pick("k", lambda: {"safe": lambda: ("safe", 3.0), "fast": broken}, GPU) == "safe"
    entry = tuning.report(GPU)["op"]["k"]
    assert entry["ms"] == {"safe": 3.0} and "does not compile" in entry["failed"]["fast"]
    assert tuning.describe(GPU) == ["op k: safe 3.0000 ms; failed: fast"]
    with pytest.raises(RuntimeError):
        tuning.TunedChoice("op2", default="fast", candidates=("fast",)).pick("k", lambda: {"fast": broken}, GPU)


def test_nothing_is_timed_or_written_off_cuda_or_during_a_capture(fake_gpu, tmp_path, monkeypatch) -> None:
    choice = tuning.TunedChoice("op", default="a", candidates=("a", "b"))
    assert choice.pick("k", timings(a=2.0, b=1.0), torch.device("cpu")) == "a"
    monkeypatch.setattr(tuning.torch.cuda, "is_current_stream_capturing", lambda: True)
    assert choice.pick("k", timings(a=2.0, b=1.0), GPU) == "a"
    assert fake_gpu == [] and not list(tmp_path.iterdir())
    assert tuning.describe_kernel_path(torch.device("cpu")).startswith("kernel path on cpu")


def test_forced_runs_one_candidate_everywhere(fake_gpu) -> None:
    choice = tuning.TunedChoice("op", default="a", candidates=("a", "b"))
    with choice.forced("b"):
        assert choice.pick("k", timings(a=1.0, b=2.0), torch.device("cpu")) == "b"
    assert choice.pick("k", timings(a=1.0, b=2.0), torch.device("cpu")) == "a"
    with pytest.raises(ValueError, match="not one of"):
        with choice.forced("z"):
            pass


def test_another_process_s_choice_stands(fake_gpu, tmp_path) -> None:
    """Two processes timing the same new key: the one that writes second takes the first one's choice."""
    choice = tuning.TunedChoice("op", default="a", candidates=("a", "b"))
    assert choice.pick("other", timings(a=1.0, b=2.0), GPU) == "a"  # loads this process's table
    path = tmp_path / "nvidia-test-gpu.json"
    data = json.loads(path.read_text())
    data["choices"]["op"]["k"] = {"chosen": "a", "ms": {"a": 1.0, "b": 1.5}}
    path.write_text(json.dumps(data))  # meanwhile another process recorded "k"
    assert choice.pick("k", timings(a=2.0, b=1.0), GPU) == "a"
    assert set(json.loads(path.read_text())["choices"]["op"]) == {"other", "k"}


def test_stale_entries_and_foreign_files_are_timed_anew(fake_gpu, tmp_path) -> None:
    choice = tuning.TunedChoice("op", default="a", candidates=("a", "b"))
    path = tmp_path / "nvidia-test-gpu.json"
    path.write_text(json.dumps({"format": tuning.FORMAT, "device": "NVIDIA Test GPU",
                                "choices": {"op": {"k": {"chosen": "gone", "ms": {}}}}}))
    assert choice.pick("k", timings(a=2.0, b=1.0), GPU) == "b"  # a candidate that no longer exists
    for foreign in ({"format": tuning.FORMAT + 1, "device": "NVIDIA Test GPU"}, {"format": tuning.FORMAT,
                    "device": "NVIDIA Other GPU"}, "not json"):
        path.write_text(foreign if isinstance(foreign, str) else json.dumps(
            foreign | {"choices": {"op": {"k": {"chosen": "a", "ms": {}}}}}))
        new_process()
        assert choice.pick("k", timings(a=2.0, b=1.0), GPU) == "b"


def test_retuning_times_every_shape_it_meets_anew(fake_gpu, tmp_path) -> None:
    choice = tuning.TunedChoice("op", default="a", candidates=("a", "b"))
    choice.pick("other", timings(a=1.0, b=2.0), GPU)
    choice.pick("k", timings(a=1.0, b=2.0), GPU)
    path = tmp_path / "nvidia-test-gpu.json"
    with tuning.retuning(GPU):
        assert choice.pick("k", timings(a=2.0, b=1.0), GPU) == "b"
        assert json.loads(path.read_text())["choices"]["op"]["k"]["chosen"] == "a"  # written at the end
    assert json.loads(path.read_text())["choices"] == {"op": {"k": {"chosen": "b", "ms": {"a": 2.0, "b": 1.0}},
                                                              "other": {"chosen": "a", "ms": {"a": 1.0, "b": 2.0}}}}
    assert choice.pick("k", timings(a=1.0, b=2.0), GPU) == "b"


def test_the_kernel_path_line_names_the_file_and_every_choice(fake_gpu, tmp_path) -> None:
    tuning.TunedChoice("op", default="a", candidates=("a", "b")).pick("k", timings(a=2.0, b=1.0), GPU)
    tuning.TunedChoice("idle", default="x", candidates=("x",))
    line = tuning.describe_kernel_path(GPU)
    assert str(tmp_path / "nvidia-test-gpu.json") in line and "idle untuned" in line and "op b x1" in line
    new_process()
    assert tuning.describe_kernel_path(GPU) == line  # the next process: the same table, the same digest


def test_tests_keep_the_cache_out_of_the_home_directory() -> None:
    """tests/conftest.py points the tuning cache at a temporary directory for the whole session."""
    assert tuning.cache_dir() != tuning.Path.home() / ".cache" / "dflash_tfm" / "tuning"


@pytest.mark.gpu
def test_candidates_see_what_the_caller_s_stream_wrote(tmp_path, monkeypatch) -> None:
    """On a real GPU: the caller's stream is still busy (a sleep, then a write) when a choice is timed, and the
    candidates, which run on the timer's own stream, read the written value, not the one before."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setattr(tuning, "_registry", {})  # the test's operator is registered afresh on every run
    session_directory = tuning.cache_dir()
    tuning.use_directory(tmp_path)
    try:
        src = torch.zeros(1, device=GPU)
        seen: list[torch.Tensor] = []
        torch.cuda._sleep(200_000_000)  # about 0.1 s of a busy stream
        src.fill_(7.0)
        choice = tuning.TunedChoice("stream_order_test", default="a", candidates=("a", "b"))
        choice.pick(("k",), lambda: {n: (lambda: seen.append(src.clone())) for n in ("a", "b")}, GPU)
        torch.cuda.synchronize()
        assert seen[0].item() == 7.0
    finally:
        tuning.use_directory(session_directory)
