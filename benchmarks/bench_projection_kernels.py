"""Every projection kernel candidate at Qwen3.6-27B shapes, with its margins (GPU script).

What the projections' tuned choice decides, as a table (`layers/linear.py`): cuBLAS against every other
candidate it times for the shape; and for one row (a decode step) the fused add + RMSNorm GEMV the decoder runs
before the mixers' input projections and gate_up against the separate kernels. Times are
`triton.testing.do_bench` medians; TB/s counts the weight bytes only.

    python -m benchmarks.bench_projection_kernels [--rows 1 16 65]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from dflash_tfm.config import ModelConfig
from dflash_tfm.kernels.linear.fused_gemv import add_norm_gemv
from dflash_tfm.layers.linear import candidates
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
    print(f"{torch.cuda.get_device_name()}; median ms (do_bench); TB/s = weight bytes / time\n")
    print("| rows | projection | N x K | separate / cuBLAS ms | best other ms | best other | TB/s (best) |")
    print("|---|---|---|---|---|---|---|")
    for name, (N, K) in shapes(cfg).items():
        w = torch.randn(N, K, device=dev, dtype=dt) / K**0.5
        gb = w.numel() * 2 / 1e12
        for rows in args.rows:
            times: dict[str, float] = {}
            if rows == 1 and name in ("attn qkv", "gdn in_proj", "mlp gate_up"):
                h, delta, g = (torch.randn(1, 1, K, device=dev, dtype=dt) for _ in range(3))
                base = ms(lambda: F.linear(add_rms_norm(h, delta, g, 1e-6, True)[1], w))
                times["fused add + norm GEMV"] = ms(lambda: add_norm_gemv(h, delta, g, 1e-6, True, w))
            else:
                x = torch.randn(1, rows, K, device=dev, dtype=dt)
                base = ms(lambda: F.linear(x, w))
                for label, fn in candidates(rows, w)[1:]:  # all but cuBLAS itself
                    try:
                        times[label] = ms(lambda fn=fn: fn(x, w))
                    except Exception as e:  # noqa: BLE001 — a candidate that does not compile is reported, not fatal
                        print(f"  ({name}, rows {rows}: {label} failed: {type(e).__name__})")
            best = min(times, key=times.get, default=None)
            cells = [f"{times[best]:.4f}", best] if best else ["—", "—"]
            fastest = min(base, times.get(best, base))
            print(f"| {rows} | {name} | {N} x {K} | {base:.4f} | {' | '.join(cells)} | {gb / (fastest / 1e3):.2f} |",
                  flush=True)
        del w
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
