"""PhaseGraphs' bookkeeping (which calls run eagerly, which are captured or replayed, eviction) with the CUDA
graph API replaced by fakes, and MeasuredChoice's decision rule with a fake timer; the real capture runs in
tests/engine/test_cuda_speculative_graphs.py on the GPU."""
from __future__ import annotations

import contextlib

import pytest

from dflash_tfm.engine import phase_graphs
from dflash_tfm.engine.phase_graphs import PhaseGraphs
from dflash_tfm.layers import measured_choice
from dflash_tfm.layers.measured_choice import MeasuredChoice


class FakeGraph:
    replays: list["FakeGraph"] = []

    def replay(self) -> None:
        FakeGraph.replays.append(self)


@pytest.fixture
def fake_cuda(monkeypatch):
    events: list[str] = []

    @contextlib.contextmanager
    def graph(g, pool=None):
        events.append("capture")
        yield

    class Stream:
        def wait_stream(self, other) -> None: ...

    monkeypatch.setattr(phase_graphs.torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(phase_graphs.torch.cuda, "graph", graph)
    monkeypatch.setattr(phase_graphs.torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(phase_graphs.torch.cuda, "Stream", Stream)
    monkeypatch.setattr(phase_graphs.torch.cuda, "current_stream", lambda: Stream())
    monkeypatch.setattr(phase_graphs.torch.cuda, "stream", lambda s: contextlib.nullcontext())
    FakeGraph.replays = []
    return events


def test_pure_phase_warms_up_captures_and_replays(fake_cuda) -> None:
    calls = []
    graphs = PhaseGraphs(enabled=True)
    graphs.run(("tree",), lambda: calls.append("tree"))
    assert calls == ["tree", "tree"] and fake_cuda == ["capture"] and len(FakeGraph.replays) == 1
    graphs.run(("tree",), lambda: calls.append("tree"))
    assert calls == ["tree", "tree"] and len(FakeGraph.replays) == 2  # a hit only replays


def test_state_advancing_phase_runs_once_for_real_then_replays(fake_cuda) -> None:
    calls = []
    graphs = PhaseGraphs(enabled=True)
    graphs.run(("commit", "greedy"), lambda: calls.append("commit"), advances_state=True)
    assert calls == ["commit", "commit"] and FakeGraph.replays == []  # eager run + capture (records only)
    graphs.run(("commit", "greedy"), lambda: calls.append("commit"), advances_state=True)
    assert len(calls) == 2 and len(FakeGraph.replays) == 1


def test_each_phase_keeps_its_most_recently_used_graphs(fake_cuda) -> None:
    graphs = PhaseGraphs(enabled=True, per_phase=2)
    graphs.run(("verify",), lambda: None)
    for t in (0.5, 0.7):
        graphs.run(("commit", t), lambda: None, advances_state=True)
    graphs.run(("commit", 0.5), lambda: None, advances_state=True)  # 0.5 becomes the most recent
    graphs.run(("commit", 0.9), lambda: None, advances_state=True)  # evicts 0.7, not 0.5 nor verify
    assert ("commit", 0.5) in graphs and ("commit", 0.9) in graphs and ("verify",) in graphs
    assert ("commit", 0.7) not in graphs


def test_disabled_graphs_just_run_the_phase() -> None:
    calls = []
    PhaseGraphs(enabled=False).run(("draft", 256), lambda: calls.append(1))
    assert calls == [1]


def test_measured_choice_keeps_the_fastest_and_defers_during_capture(monkeypatch) -> None:
    import triton.testing

    timings = {"a": 2.0, "b": 1.0}
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", lambda fn, **kw: timings[fn()])
    choice = MeasuredChoice(default="a")
    monkeypatch.setattr(measured_choice.torch.cuda, "is_current_stream_capturing", lambda: True)
    assert choice.pick("k", lambda: {"a": lambda: "a", "b": lambda: "b"}) == "a" and "k" not in choice.choices
    monkeypatch.setattr(measured_choice.torch.cuda, "is_current_stream_capturing", lambda: False)
    assert choice.pick("k", lambda: {"a": lambda: "a", "b": lambda: "b"}) == "b"
    timings["b"] = 9.0  # decided once: not re-timed
    assert choice.pick("k", lambda: {"a": lambda: "a", "b": lambda: "b"}) == "b"


def test_measured_choice_keeps_the_default_unless_clearly_faster(monkeypatch) -> None:
    import triton.testing

    timings = {"a": 1.0, "b": 0.99, "c": 1.5}
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", lambda fn, **kw: timings[fn()])
    monkeypatch.setattr(measured_choice.torch.cuda, "is_current_stream_capturing", lambda: False)
    candidates = {name: (lambda name=name: name) for name in timings}
    assert MeasuredChoice(default="a").pick("k", lambda: candidates) == "a"  # 1 % is within noise
    timings["b"] = 0.9
    choice = MeasuredChoice(default="a")
    assert choice.pick("k", lambda: candidates) == "b"
    assert choice.report() == {"k": {"chosen": "b", "ms": {"a": 1.0, "b": 0.9, "c": 1.5}}}
    assert choice.describe() == ["k: b 0.9000 ms (default a 1.0000 ms)"]


def test_measured_choice_leaves_out_a_candidate_that_fails(monkeypatch) -> None:
    import triton.testing

    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", lambda fn, **kw: fn())
    monkeypatch.setattr(measured_choice.torch.cuda, "is_current_stream_capturing", lambda: False)

    def broken() -> float:
        raise RuntimeError("does not compile here")

    choice = MeasuredChoice(default="safe")
    assert choice.pick("k", lambda: {"safe": lambda: 3.0, "fast": broken}) == "safe"
    assert "does not compile" in choice.failures["k"]["fast"]
    assert choice.report() == {"k": {"chosen": "safe", "ms": {"safe": 3.0},
                                     "failed": {"fast": "RuntimeError: does not compile here"}}}
    assert choice.describe() == ["k: safe 3.0000 ms; failed: fast"]
    with pytest.raises(RuntimeError):
        MeasuredChoice(default="fast").pick("k", lambda: {"fast": broken})


def test_measured_choice_times_nothing_it_cannot_time(monkeypatch) -> None:
    """can_time=False (tensors not on CUDA): the default without timing or deciding, or a choice already set."""
    import triton.testing

    def no_timing(fn, **kw):
        raise AssertionError("nothing may be timed")

    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", no_timing)
    monkeypatch.setattr(measured_choice.torch.cuda, "is_current_stream_capturing", lambda: False)
    choice = MeasuredChoice(default="a")
    assert choice.pick("k", lambda: {"a": lambda: "a", "b": lambda: "b"}, can_time=False) == "a"
    assert "k" not in choice.choices
    choice.choices["k"] = "b"
    assert choice.pick("k", lambda: {}, can_time=False) == "b"
