"""Autoregressive decode step of a random-weight target (GPU script): Qwen3.6-27B-shaped BF16 by default, or
Qwen3.5-35B-A3B-shaped (`--target qwen3.5-35b-a3b`); with `--quantization fp8` its projections are held in FP8
(benchmarks/fp8_targets.py) and the floor counts FP8 bytes.

Measures, with CUDA events after warm-up (median of many steps):
  * the device-to-device copy bandwidth (bytes read + written), hence the bandwidth floor of one decode step
    = the weight bytes one token reads / copy bandwidth (`fp8_targets.bytes_per_token`: every weight but the
    embedding table's other rows and, on a MoE target, the experts the token is not routed to);
  * our CUDA-graph decode step at contexts 1k and 4k (graph replay only), and the full per-token loop the
    engine runs (replay + greedy argmax + reading the token on the host);
  * optionally (--hf) the same config through `transformers` (1-token forward with its cache).

    python -m benchmarks.bench_ar_decode [--target qwen3.5-35b-a3b] [--quantization fp8] --out $OUT/ar_decode.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.fp8_targets import TARGETS, bytes_per_token, random_target
from benchmarks.timing import report_choices, time_ms
from dflash_tfm.config import ModelConfig
from dflash_tfm.engine.model_runner import ModelRunner
from dflash_tfm.layers.fp8_weight import Fp8Weight
from dflash_tfm.layers.linear import linear


def copy_bandwidth(gib: float = 4.0, iters: int = 20) -> float:
    """Bytes read + written per second of a large device-to-device copy (random data)."""
    n = int(gib * 2**30) // 2
    src = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), iters, warmup=3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n * 2 / (ms / 1e3)


def gemv_only_ms(model, iters: int) -> float:
    """One step's matrix-vector products alone (every projection + lm_head, batch 1), as one CUDA graph:
    the part of the step that is pure weight streaming through cuBLAS."""
    weights = [p for n, p in model.named_parameters() if p.dim() == 2 and not n.endswith("conv_weight")
               and not (n == "embed_tokens" and model.lm_head is not None)]
    weights += [m for m in model.modules() if isinstance(m, Fp8Weight) and m.weight.dim() == 2]  # FP8 kernel
    inputs = [torch.randn(1, w.shape[1], dtype=model.embed_tokens.dtype, device=model.embed_tokens.device)
              for w in weights]
    graph = torch.cuda.CUDAGraph()
    for _ in range(2):
        for x, w in zip(inputs, weights):
            linear(x, w)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        outs = [linear(x, w) for x, w in zip(inputs, weights)]
    del outs
    return time_ms(graph.replay, iters)


def bench_ours(cfg: ModelConfig, contexts: list[int], iters: int, quantization: str | None) -> tuple[dict, int]:
    model = random_target(cfg, torch.device("cuda"), torch.bfloat16, max(contexts) + 1024, quantization)
    weight_bytes = bytes_per_token(model)
    gemv_ms = gemv_only_ms(model, iters)
    print(f"GEMV-only step (2-D projections): {gemv_ms:.2f} ms", flush=True)
    default_blas = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")  # does cuBLASLt stream the weights faster?
    lt_ms = gemv_only_ms(model, iters)
    torch.backends.cuda.preferred_blas_library(default_blas)
    print(f"GEMV-only step through cuBLASLt: {lt_ms:.2f} ms", flush=True)
    runner = ModelRunner(model, max_len=max(contexts) + 512, device=torch.device("cuda"))
    results: dict = {"gemv_only_ms": gemv_ms, "gemv_only_cublaslt_ms": lt_ms}
    for ctx in contexts:
        runner.reset()
        prompt = torch.randint(0, cfg.vocab_size, (ctx,), device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits, _ = runner.prefill(prompt)
        torch.cuda.synchronize()
        prefill_s = time.perf_counter() - t0
        token = logits.argmax().view(1)
        pos = ctx
        runner.decode(token, pos)  # captures the graph of this bucket
        torch.cuda.synchronize()

        def replay_only() -> None:
            runner.decode(token, pos)

        step_ms = time_ms(replay_only, iters)

        def engine_loop() -> None:
            nonlocal token, pos
            logits = runner.decode(token, pos)
            token = logits.argmax(dim=-1)
            int(token.item())
            pos += 1

        loop_ms = time_ms(engine_loop, iters)
        results[ctx] = {"prefill_s": prefill_s, "graph_step_ms": step_ms, "engine_loop_ms": loop_ms}
        print(f"ctx {ctx}: prefill {prefill_s:.2f} s, graph step {step_ms:.2f} ms, loop {loop_ms:.2f} ms", flush=True)
    report_choices(results)
    del runner, model
    torch.cuda.empty_cache()
    return results, weight_bytes


def bench_transformers(raw: dict, ctx: int, iters: int) -> dict:
    """The same config through transformers' Qwen3_5ForCausalLM (1-token forward with its DynamicCache)."""
    import transformers as tf

    cfg = tf.Qwen3_5TextConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    with torch.device("meta"):
        model = tf.Qwen3_5ForCausalLM(cfg)
    model = model.to_empty(device="cuda").to(torch.bfloat16).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
        ids = torch.randint(0, cfg.vocab_size, (1, ctx), device="cuda")
        out = model(input_ids=ids, use_cache=True)
        cache = out.past_key_values
        nxt = out.logits[:, -1:].argmax(-1)
        ms = time_ms(lambda: model(input_ids=nxt, past_key_values=cache, use_cache=True), iters)
    del model
    torch.cuda.empty_cache()
    return {"ctx": ctx, "forward_1tok_ms": ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--hf", action="store_true", help="also time transformers' implementation (slow)")
    ap.add_argument("--quantization", default=None, choices=["fp8"], help="hold the projections in FP8")
    ap.add_argument("--target", default="qwen3.6-27b", choices=sorted(TARGETS), help="the shapes of the target")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.hf and args.target != "qwen3.6-27b":
        ap.error("--hf times the dense 27B target only")
    raw = TARGETS[args.target][0]
    cfg = ModelConfig.from_dict(raw)
    bw = copy_bandwidth()
    ours, weight_bytes = bench_ours(cfg, args.contexts, args.iters, args.quantization)
    floor_ms = weight_bytes / bw * 1e3
    report = {
        "gpu": torch.cuda.get_device_name(),
        "target": args.target,
        "quantization": args.quantization,
        "copy_bandwidth_TBps": bw / 1e12,
        "bytes_per_token_GB": weight_bytes / 1e9,
        "floor_ms": floor_ms,
        "floor_tok_s": 1e3 / floor_ms,
        "ours": ours,
    }
    if args.hf:
        report["transformers"] = bench_transformers(raw, args.contexts[0], max(5, args.iters // 10))
    print(f"\n{args.target}: copy bandwidth {bw / 1e12:.2f} TB/s; a token reads {weight_bytes / 1e9:.2f} GB of "
          f"weights; floor {floor_ms:.2f} ms "
          f"= {1e3 / floor_ms:.1f} tok/s")
    print("| context | graph step ms | tok/s | % of floor | engine loop ms | tok/s |")
    print("|---|---|---|---|---|---|")
    print(f"GEMV-only (all projections + lm_head, one graph): {ours['gemv_only_ms']:.2f} ms")
    for ctx, r in ours.items():
        if not isinstance(ctx, int):
            continue
        print(f"| {ctx} | {r['graph_step_ms']:.2f} | {1e3 / r['graph_step_ms']:.1f} | "
              f"{100 * floor_ms / r['graph_step_ms']:.1f}% | {r['engine_loop_ms']:.2f} | {1e3 / r['engine_loop_ms']:.1f} |")
    if "transformers" in report:
        print(f"transformers 1-token forward at ctx {args.contexts[0]}: {report['transformers']['forward_1tok_ms']:.1f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
