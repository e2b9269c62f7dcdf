"""The routed experts of a Qwen3.5-35B-A3B MoE block on one GPU: the Triton grouped GEMMs against the gathered
PyTorch twin (a script, not a test).

For T = 1, 4, 8, 16, 32, 65 tokens (decode, drafter blocks, tree verify) each path is captured in one CUDA graph
holding the call for ``--layers`` blocks, each with its own weights (1.5 GB of experts per block, so no expert
stays in L2 from one call to the next), and timed by graph replay (median µs per block). Effective GB/s is the
bytes of expert weights the routing touches (distinct experts × (2I·H + H·I) × 2 bytes, averaged over the
blocks) over the time. The whole block (router, shared expert, routed experts) is timed the same way with the
Triton path. The routing is the blocks' own router on random normed rows, so the experts spread as a random
router spreads them.

``--sweep`` also times the grouped GEMMs at a few tile settings per T (`ExpertTiles`) and marks the fastest,
the evidence for `default_tiles`.

    python -m benchmarks.bench_moe_experts [--tokens 1 4 8 16 32 65] [--layers 8] [--sweep] [--out moe.json]
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict

import torch

from benchmarks.timing import time_graph
from dflash_tfm.kernels.moe.grouped_experts import ExpertTiles, default_tiles, routed_experts
from dflash_tfm.kernels.moe.reference import gathered_expert_outputs, mix
from dflash_tfm.layers.moe import SparseMoE, route
from dflash_tfm.models.presets import QWEN3_5_35B_A3B

CFG = QWEN3_5_35B_A3B
H, E, K = CFG["hidden_size"], CFG["num_experts"], CFG["num_experts_per_tok"]
I, S = CFG["moe_intermediate_size"], CFG["shared_expert_intermediate_size"]
EXPERT_BYTES = 3 * I * H * 2  # gate, up and down of one expert in bf16
SWEEP = [ExpertTiles(16, 32, 128, 4, 4), ExpertTiles(16, 64, 128, 4, 4), ExpertTiles(16, 32, 256, 4, 3),
         ExpertTiles(16, 64, 64, 4, 4), ExpertTiles(16, 128, 64, 4, 3), ExpertTiles(16, 32, 128, 2, 4),
         ExpertTiles(32, 64, 64, 4, 3)]


def random_block(seed: int) -> SparseMoE:
    """A 35B-A3B MoE block in bf16 with random weights at the checkpoint's scale (std 1/√fan-in)."""
    moe = SparseMoE(H, E, K, I, S, normalise_top_k=True).to("cuda", torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
    return moe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 16, 32, 65])
    ap.add_argument("--layers", type=int, default=8, help="blocks with their own weights per graph")
    ap.add_argument("--sweep", action="store_true", help="also time the grouped GEMMs at the SWEEP tiles")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    blocks = [random_block(seed) for seed in range(args.layers)]
    rows_out = []
    print(f"Qwen3.5-35B-A3B MoE block: H={H}, E={E}, top-{K}, I={I}, shared {S}; bf16, {args.layers} blocks per "
          f"graph, {torch.cuda.get_device_name()}")
    print("| T | experts touched | MB | Triton µs | GB/s | gathered µs | GB/s | speed-up | block µs (Triton) |")
    print("|---|---|---|---|---|---|---|---|---|")
    with torch.inference_mode():
        for tokens in args.tokens:
            x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
            routing = []
            for moe in blocks:
                weights, experts = route(x @ moe.in_proj[:E].T, K, True)
                routing.append((weights.to(x.dtype), experts))
            touched = sum(experts.unique().numel() for _, experts in routing) / len(routing)
            nbytes = touched * EXPERT_BYTES

            def triton_path(layer: int, tiles: ExpertTiles | None = None) -> torch.Tensor:
                moe, (weights, experts) = blocks[layer], routing[layer]
                return routed_experts(x, weights, experts, moe.experts_gate_up, moe.experts_down, tiles)

            def gathered(layer: int) -> torch.Tensor:
                moe, (weights, experts) = blocks[layer], routing[layer]
                return mix(gathered_expert_outputs(x, experts, moe.experts_gate_up, moe.experts_down), weights)

            triton_us = time_graph(triton_path, args.layers)
            gathered_us = time_graph(gathered, args.layers)
            block_us = time_graph(lambda layer: blocks[layer](x), args.layers)
            row = dict(tokens=tokens, experts_touched=touched, expert_bytes=nbytes, triton_us=triton_us,
                       triton_gbps=nbytes / triton_us / 1e3, gathered_us=gathered_us,
                       gathered_gbps=nbytes / gathered_us / 1e3, block_us=block_us,
                       default_tiles=asdict(default_tiles(tokens * K, E)))
            print(f"| {tokens} | {touched:.1f} | {nbytes / 1e6:.0f} | {triton_us:.1f} | {row['triton_gbps']:.0f} | "
                  f"{gathered_us:.1f} | {row['gathered_gbps']:.0f} | {gathered_us / triton_us:.2f}x | "
                  f"{block_us:.1f} |", flush=True)
            if args.sweep:
                row["sweep"] = sweep(triton_path, tokens, nbytes, args.layers)
            rows_out.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), hidden=H, experts=E, top_k=K, expert_width=I,
                           layers=args.layers, rows=rows_out), f, indent=2)


def sweep(triton_path, tokens: int, nbytes: float, layers: int) -> list[dict]:
    """µs per block of the grouped GEMMs at each SWEEP tile setting (and the default), fastest marked."""
    timed = [(time_graph(lambda layer, t=t: triton_path(layer, t), layers), t) for t in SWEEP]
    best = min(timed, key=lambda pair: pair[0])[1]
    print(f"  T={tokens} tiles (default {default_tiles(tokens * K, E)}):")
    for us, t in timed:
        mark = "  <- fastest" if t == best else ""
        print(f"    {t}: {us:.1f} µs, {nbytes / us / 1e3:.0f} GB/s{mark}", flush=True)
    return [dict(tiles=asdict(t), us=us, fastest=t == best) for us, t in timed]


if __name__ == "__main__":
    main()
