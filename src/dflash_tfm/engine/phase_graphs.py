"""CUDA graphs for the phases of a decode step, captured on first use per key and replayed afterwards.

A phase is a function that reads static input buffers and writes static output buffers (or rebinds its
outputs to the tensors it creates, which under capture live in the graphs' shared memory pool and stay put).
Two kinds:

* pure phases (draft, tree, verify) give the same outputs when run twice on the same inputs, so a miss
  runs the phase once eagerly as warm-up (Triton compiles, cuBLAS picks algorithms, inductor traces), then
  captures it and replays the capture: the caller always gets the graph's outputs;
* a state-advancing phase (commit) must run exactly once per step, so a miss runs it eagerly as the real work
  and captures it for the next call.

All graphs share one memory pool: they run one after another on one stream, and every tensor passed between
phases is kept referenced by the caller, so no graph's output is ever reused as another's scratch. Keys are
tuples whose first item names the phase; each phase keeps at most `per_phase` graphs (least recently used
go first), so e.g. a server seeing many different sampling settings does not accumulate graphs.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch


class PhaseGraphs:
    def __init__(self, enabled: bool, per_phase: int = 8) -> None:
        self.enabled = enabled
        self.per_phase = per_phase
        self._graphs: OrderedDict[tuple, torch.cuda.CUDAGraph] = OrderedDict()
        self._pool = None

    def __contains__(self, key: tuple) -> bool:
        return key in self._graphs

    def run(self, key: tuple, phase: Callable[[], None], advances_state: bool = False) -> None:
        """Replay the graph of `key` (phase name first), or on a miss run `phase` and capture it."""
        if not self.enabled:
            phase()
            return
        graph = self._graphs.get(key)
        if graph is not None:
            self._graphs.move_to_end(key)
            graph.replay()
            return
        same_phase = [k for k in self._graphs if k[0] == key[0]]
        if len(same_phase) >= self.per_phase:
            del self._graphs[same_phase[0]]  # the least recently used of this phase
        side = torch.cuda.Stream()  # warm-up off the default stream, as capture requires
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            phase()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            phase()
        self._graphs[key] = graph
        if not advances_state:
            graph.replay()
