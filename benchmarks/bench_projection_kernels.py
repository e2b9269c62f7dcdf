"""Every projection kernel choice at Qwen3.6-27B shapes, with its margins (GPU script).

What `MeasuredChoice` decides silently, as a table: for one row (a decode step) the separate kernels (add +
RMSNorm, cuBLAS GEMV) against the fused Triton GEMV; for 16 and 65 rows (drafter
block, tree verify) cuBLAS against each skinny-matmul configuration. Times are `triton.testing.do_bench` medians; TB/s counts the weight bytes only.

    python -m benchmarks.bench_projection_kernels [--rows 1 16 65]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from dflash_tfm.config import ModelConfig
from dflash_tfm.kernels.linear.fused_gemv import add_norm_gemv
from dflash_tfm.kernels.linear.skinny_matmul import candidate_configs, skinny_matmul
from dflash_tfm.layers.norm import add_rms_norm
from dflash_tfm.models.presets import QWEN3_6_27B


def shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Projection name -> (N, K) of the 27B target."""
    H = cfg.hidden_size
    q = cfg.num_heads * cfg.head_dim * 2  # gated attention: query | gate
    return {
        "attn qkv": (q + 2 * cfg.num_kv_heads * cfg.head_dim, H),
        "attn o": (H, cfg.num_heads * cfg.head_dim),
        "gdn in_proj": (cfg.gdn_conv_dim + cfg.gdn_value_dim + 2 * cfg.linear_num_value_heads, H),
        "gdn out_proj": (H, cfg.gdn_value_dim),
        "mlp gate_up": (2 * cfg.intermediate_size, H),
        "mlp down": (H, cfg.intermediate_size),
        "lm_head": (cfg.vocab_size, H),
    }


def ms(fn) -> float:
    return do_bench(fn, warmup=10, rep=50)


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 65])
    args = ap.parse_args()
    cfg = ModelConfig.from_dict(QWEN3_6_27B)
    dev, dt = torch.device("cuda"), torch.bfloat16
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"{torch.cuda.get_device_name()}; median ms (do_bench); TB/s = weight bytes / time\n")
    print("| rows | projection | N x K | separate / cuBLAS ms | best Triton ms | Triton config | TB/s (best) |")
    print("|---|---|---|---|---|---|---|")
    for name, (N, K) in shapes(cfg).items():
        w = torch.randn(N, K, device=dev, dtype=dt) / K**0.5
        gb = w.numel() * 2 / 1e12
        for rows in args.rows:
            triton_times: dict[str, float] = {}
            if rows == 1:
                if name in ("attn qkv", "gdn in_proj", "mlp gate_up"):
                    h, delta, g = (torch.randn(1, 1, K, device=dev, dtype=dt) for _ in range(3))
                    base = ms(lambda: F.linear(add_rms_norm(h, delta, g, 1e-6, True)[1], w))
                    triton_times["fused add + norm GEMV"] = ms(lambda: add_norm_gemv(h, delta, g, 1e-6, True, w))
                else:
                    x = torch.randn(1, 1, K, device=dev, dtype=dt)
                    base = ms(lambda: F.linear(x, w))
            else:
                x = torch.randn(1, rows, K, device=dev, dtype=dt)
                base = ms(lambda: F.linear(x, w))
                for config in candidate_configs(rows, N, K, sms):
                    try:
                        triton_times[str(config)] = ms(lambda c=config: skinny_matmul(x, w, c))
                    except Exception as e:  # noqa: BLE001 — a config that does not compile is reported, not fatal
                        print(f"  ({name}, rows {rows}: {config} failed: {type(e).__name__})")
            best = min(triton_times, key=triton_times.get, default=None)
            cells = [f"{triton_times[best]:.4f}", best] if best else ["—", "—"]
            fastest = min(base, triton_times.get(best, base))
            print(f"| {rows} | {name} | {N} x {K} | {base:.4f} | {' | '.join(cells)} | {gb / (fastest / 1e3):.2f} |",
                  flush=True)
        del w
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
