"""One DFlash block draft of the Qwen3.6-27B drafter shape (1.73B params, random BF16 weights; GPU script).

The drafter borrows only `embed_tokens` and `lm_head` from the target, so a stand-in holding those two
tensors (248320 x 5120 each) replaces the 56 GB target. Measured with CUDA events after warm-up (median):
  * `draft` eagerly and as a CUDA-graph replay (position in a device tensor, `kv_len` = power-of-two bucket),
    at context lengths 1024 and 4096;
  * `append_context` of 16 committed tokens (eager), the per-step cost of keeping the context cache current;
  * the bandwidth floor of a draft: drafter weights + lm_head + K/V read, over the device copy bandwidth.

    python benchmarks/bench_dflash_draft.py --out $OUT/dflash_draft.json [--profile]

--profile also prints the kernels of one draft and one 16-token context append at the first context.
"""
from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import torch

from benchmarks.bench_ar_decode import copy_bandwidth
from benchmarks.kernel_profile import print_kernel_table
from benchmarks.timing import report_choices, time_ms
from dflash_tfm.layers.linear import skinny_projections
from dflash_tfm.models.presets import QWEN3_6_27B, QWEN3_6_27B_DFLASH
from dflash_tfm.models.random_init import init_random_
from dflash_tfm.spec.dflash import DFlashDrafter
from dflash_tfm.spec.dflash_config import DFlashConfig

def bucket(n: int, max_len: int, minimum: int = 256) -> int:
    """Smallest power of two >= n (and >= minimum), capped at max_len: the static kv_len of one graph."""
    b = minimum
    while b < n:
        b *= 2
    return min(b, max_len)


def capture(drafter: DFlashDrafter, root: torch.Tensor, pos: torch.Tensor, kv_len: int) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            drafter.draft(root, pos, kv_len)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        drafter.draft(root, pos, kv_len)
    return graph


@torch.inference_mode()
@skinny_projections()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--no-graph", action="store_true")
    ap.add_argument("--profile", action="store_true", help="kernel tables of a draft and a context append")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    cfg = DFlashConfig.from_dict(QWEN3_6_27B_DFLASH)
    V, H = QWEN3_6_27B["vocab_size"], QWEN3_6_27B["hidden_size"]
    heads = SimpleNamespace(
        embed_tokens=torch.randn(V, H, device=dev, dtype=dtype) * 0.02,
        lm_head_weight=torch.randn(V, H, device=dev, dtype=dtype) / H**0.5,
    )
    max_len = bucket(max(args.contexts) + cfg.block_size, 1 << 30)
    drafter = init_random_(DFlashDrafter(cfg, heads, max_len=max_len))
    weight_bytes = sum(p.numel() * p.element_size() for p in drafter.parameters())
    head_bytes = heads.lm_head_weight.numel() * heads.lm_head_weight.element_size()
    bw = copy_bandwidth()
    root = torch.tensor([17], device=dev)
    rows = []
    for ctx in args.contexts:
        drafter.reset()
        for s in range(0, ctx, 1024):  # prefill the context cache in chunks
            n = min(1024, ctx - s)
            drafter.append_context(torch.randn(1, n, cfg.num_taps * H, device=dev, dtype=dtype), s)
        kv_len = bucket(ctx + cfg.block_size, max_len)
        eager_ms = time_ms(lambda: drafter.draft(root, ctx, kv_len), args.iters)
        commit = torch.randn(1, 16, cfg.num_taps * H, device=dev, dtype=dtype)
        append_ms = time_ms(lambda: drafter.append_context(commit, ctx - 16), args.iters)
        graph_ms = None
        if not args.no_graph:
            pos = torch.tensor(ctx, device=dev)
            graph = capture(drafter, root, pos, kv_len)
            graph_ms = time_ms(graph.replay, args.iters)
            del graph
        window_slots = cfg.sliding_window - 1 + cfg.block_size  # what a sliding layer gathers
        slots = sum(window_slots if layer.sliding and window_slots < kv_len else kv_len for layer in drafter.layers)
        kv_bytes = slots * 2 * cfg.num_kv_heads * cfg.head_dim * 2  # K and V, bf16
        floor_ms = (weight_bytes + head_bytes + kv_bytes) / bw * 1e3
        rows.append(dict(ctx=ctx, kv_len=kv_len, eager_ms=eager_ms, graph_ms=graph_ms, append16_ms=append_ms,
                         floor_ms=floor_ms))
        print(rows[-1], flush=True)
        if args.profile and ctx == args.contexts[0]:
            print_kernel_table(lambda: drafter.draft(root, ctx, kv_len), f"draft at context {ctx}")
            print_kernel_table(lambda: drafter.append_context(commit, ctx - 16), "append 16 context tokens")
    print(f"\n{torch.cuda.get_device_name()}; copy bandwidth {bw / 1e12:.2f} TB/s; drafter weights "
          f"{weight_bytes / 1e9:.2f} GB + lm_head {head_bytes / 1e9:.2f} GB")
    report_choices({})
    print("| context | kv_len | draft eager ms | draft graph ms | floor ms | % of floor (graph) | append 16 ms |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        g = r["graph_ms"]
        graph_cells = f"{g:.3f} | {r['floor_ms']:.3f} | {100 * r['floor_ms'] / g:.0f}%" if g else f"— | {r['floor_ms']:.3f} | —"
        print(f"| {r['ctx']} | {r['kv_len']} | {r['eager_ms']:.3f} | {graph_cells} | {r['append16_ms']:.3f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "copy_bandwidth_TBps": bw / 1e12,
                       "weight_GB": weight_bytes / 1e9, "lm_head_GB": head_bytes / 1e9, "rows": rows, **choices},
                      f, indent=2)


if __name__ == "__main__":
    main()
