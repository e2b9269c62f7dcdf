"""PhaseGraphs' bookkeeping (which calls run eagerly, which are captured or replayed, eviction) with the CUDA
graph API replaced by fakes; the real capture runs in tests/engine/test_cuda_speculative_graphs.py on the GPU."""
from __future__ import annotations

import contextlib

import pytest

from dflash_tfm.engine import phase_graphs
from dflash_tfm.engine.phase_graphs import PhaseGraphs


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
