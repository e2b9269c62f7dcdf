"""Does warming L2 with part of the next weight during a latency-bound phase speed up that GEMM? (GPU script,
not a test.)

Two windows of a Qwen3.6-27B verify step (`layers/weight_prefetch.py`), each over 48 layers with their own
weights (nothing stays in L2 from one layer to the next), one CUDA graph per variant, median µs per layer:

- mixer: the GDN tree solve (N = rows nodes), then out_proj (rows × 6144 → 5120, 63 MB of bf16 weight);
  P MiB of out_proj in each `l2_prefetch` layout (its first bytes, the start of every row, pieces spread
  over all of it) prefetched on the main stream before the solve, or on a side stream (`ahead_of`, as the
  model runs it);
- short: gate_up (rows × 5120 → 34816), silu · mul, then down (rows × 17408 → 5120, 178 MB), P MiB of down
  in each layout prefetched on a side stream while silu · mul runs.

``--out`` writes every time and, per window, the fastest side-stream setting (MiB and layout) if it beats
no prefetch by more than 1 %: `bench_verify_step --prefetch-from` turns those into its runs.

    python -m benchmarks.bench_l2_prefetch [--rows 65] [--mib 8 16 24 32 40 48] [--short-mib 4 8 16 24]
        [--out l2_prefetch.json]
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from benchmarks.bench_tree_kernels import DK, DV, HV, gdn_inputs, tree
from benchmarks.timing import time_graph
from dflash_tfm.kernels import gdn_tree_verify
from dflash_tfm.kernels.linear.l2_prefetch import LAYOUTS, l2_prefetch
from dflash_tfm.layers.mlp import silu_and_mul
from dflash_tfm.layers.weight_prefetch import ahead_of, prefetching

LAYERS, HIDDEN, VALUE_DIM, FFN = 48, 5120, 6144, 17408
MIN_GAIN = 0.01  # a side-stream setting is recommended only when this much faster than no prefetch


class Window:
    """One window's timings as they are printed: the baseline, then (MiB, layout) settings per stream."""

    def __init__(self, title: str) -> None:
        print(f"\n{title}\n| variant | µs per layer |\n|---|---|", flush=True)
        self.times: dict[str, float] = {}
        self.side: dict[tuple[int, str], float] = {}

    def add(self, name: str, us: float, side: tuple[int, str] | None = None) -> None:
        print(f"| {name} | {us:.2f} |", flush=True)
        self.times[name] = us
        if side is not None:
            self.side[side] = us

    def best(self, baseline: str) -> dict | None:
        """The fastest side-stream setting, if it beats the baseline by MIN_GAIN."""
        if not self.side:
            return None
        (mib, layout), us = min(self.side.items(), key=lambda item: item[1])
        base = self.times[baseline]
        return {"mib": mib, "layout": layout, "us": us, "baseline_us": base} if us < (1 - MIN_GAIN) * base else None


def mixer_window(rows: int, mibs: list[int]) -> dict:
    weights = [torch.randn(HIDDEN, VALUE_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
    x = torch.randn(rows, VALUE_DIM, device="cuda", dtype=torch.bfloat16)
    parents, bits, _ = tree(rows)
    inputs = gdn_inputs(rows)
    states = [torch.randn(1, HV, DK, DV, device="cuda") * 0.1 for _ in range(LAYERS)]

    def gdn(layer: int) -> None:
        i = inputs
        gdn_tree_verify(i["q"], i["k"], i["v"], i["g"], i["beta"], parents, states[layer], ancestors=bits)

    def gemm(layer: int) -> None:
        F.linear(x, weights[layer])

    def forked(layer: int) -> None:
        with ahead_of(weights[layer], "mixer", x):
            gdn(layer)
        gemm(layer)

    window = Window(f"mixer window: tree solve of {rows} nodes, then out_proj "
                    f"({weights[0].numel() * 2 / 2**20:.0f} MiB)")
    window.add("solve", time_graph(gdn, LAYERS))
    window.add("out_proj", time_graph(gemm, LAYERS))
    window.add("solve; out_proj", time_graph(lambda l: (gdn(l), gemm(l)), LAYERS))
    for mib in mibs:
        for layout in LAYOUTS:
            def step(layer: int, n: int = mib << 20, lay: str = layout) -> None:
                l2_prefetch(weights[layer], n, lay)
                gdn(layer)
                gemm(layer)
            window.add(f"prefetch {mib} MiB {layout} (main stream); solve; out_proj", time_graph(step, LAYERS))
            with prefetching(mixer=mib << 20, mixer_layout=layout):
                window.add(f"prefetch {mib} MiB {layout} (side stream, ahead_of) || solve; out_proj",
                           time_graph(forked, LAYERS), side=(mib, layout))
    return {"times_us": window.times, "best": window.best("solve; out_proj")}


def short_window(rows: int, mibs: list[int]) -> dict:
    gate_up = [torch.randn(2 * FFN, HIDDEN, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
    down = [torch.randn(HIDDEN, FFN, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
    x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)

    def mlp(layer: int) -> None:
        h = F.linear(x, gate_up[layer])
        with ahead_of(down[layer], "short", h):
            act = silu_and_mul(h)
        F.linear(act, down[layer])

    window = Window(f"short window: gate_up, silu · mul, down ({down[0].numel() * 2 / 2**20:.0f} MiB), {rows} rows")
    window.add("gate_up; silu·mul; down", time_graph(mlp, LAYERS))
    for mib in mibs:
        for layout in LAYOUTS:
            with prefetching(short=mib << 20, short_layout=layout):
                window.add(f"gate_up; silu·mul || prefetch {mib} MiB {layout} of down; down", time_graph(mlp, LAYERS),
                           side=(mib, layout))
    return {"times_us": window.times, "best": window.best("gate_up; silu·mul; down")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=65, help="GEMM rows and tree nodes")
    ap.add_argument("--mib", type=int, nargs="+", default=[8, 16, 24, 32, 40, 48])
    ap.add_argument("--short-mib", type=int, nargs="+", default=[4, 8, 16, 24])
    ap.add_argument("--out", default=None, help="JSON: every time, and the best side-stream setting per window")
    args = ap.parse_args()
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}: L2 {props.L2_cache_size / 2**20:.0f} MiB")
    with torch.inference_mode():
        results = {"rows": args.rows, "mixer": mixer_window(args.rows, args.mib),
                   "short": short_window(args.rows, args.short_mib)}
    for name in ("mixer", "short"):
        best = results[name]["best"]
        print(f"best {name} setting: " + ("none beats no prefetch" if best is None else
              f"{best['mib']} MiB {best['layout']}, {best['us']:.2f} against {best['baseline_us']:.2f} µs"))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
