"""The flags that build an `Engine`, shared by `dflash-tfm generate`, the demo's siblings and the server:
the target (path, dtype, quantization, device, context), CUDA graphs, tensor parallelism, and the speculative flags of `SpeculativeConfig`."""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from dflash_tfm.speculative_config import add_speculative_args, speculative_config_from_args

if TYPE_CHECKING:
    from dflash_tfm.engine.engine import Engine


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-path", default=None, help="local HF directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--quantization", default=None, choices=["fp8"],
                   help="hold the target's projections in FP8 (128 x 128 blocks), quantized at load from BF16 "
                        "weights; FP8 checkpoints load as FP8 without it. The drafter and Weaver stay BF16")
    p.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda if available)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length the static caches are sized for")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--tp-size", type=int, default=1,
                   help="tensor parallelism: split the target over N processes, one per GPU (NCCL) or CPU process "
                        "(gloo); the command starts the N processes itself (or runs as one of them under torchrun)")
    p.add_argument("--ep-size", type=int, default=1,
                   help="expert parallelism: 1, or the --tp-size to have each rank hold 1 / N of a mixture-of-experts "
                        "target's routed experts whole instead of a slice of every expert")
    add_speculative_args(p)


def engine_from_args(args: argparse.Namespace) -> Engine:
    """The Engine the flags describe (SpeculativeConfigError, a ValueError, for impossible speculative flags).
    Engine is imported here, not at the top, so parsing flags (`--help`, flag errors) does not load torch."""
    from dflash_tfm.engine.engine import Engine

    return Engine(args.model_path, speculative_config_from_args(args), device=args.device, dtype=args.dtype,
                  quantization=args.quantization, max_model_len=args.max_model_len, use_cuda_graph=not args.disable_cuda_graph,
                  tp_size=args.tp_size, ep_size=args.ep_size)
