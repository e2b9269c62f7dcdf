"""`dflash-tfm` command line: one entry point, one subcommand per job.

Subcommands are registered here as their capability lands; an input error prints one line naming the
problem (no traceback) and exits with status 2.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from dflash_tfm.engine.args import add_engine_args, engine_from_args

# Subcommands implemented by a module's own `main(argv)` (flags as in the original system's tools), with the
# install extra whose packages they need beyond the core.
DELEGATED = {
    "serve": ("dflash_tfm.launch_server", "HTTP server (same flags as python -m dflash_tfm.launch_server)", "server"),
    "bench": ("dflash_tfm.bench.harness", "benchmark a running server (same flags as python -m dflash_tfm.bench_dflash_tfm)",
              "bench"),
    "gen-data": ("dflash_tfm.train.data", "generate training data: the target's responses to training prompts", None),
    "train-dflash": ("dflash_tfm.train.dflash_trainer", "train a DFlash drafter for a target", None),
    "train-weaver": ("dflash_tfm.train.weaver_trainer", "train a Weaver for a target and its (frozen) drafter", None),
    "demo": ("dflash_tfm.demo", "AR vs DFLASH vs DDTREE vs DFLASH_TFM on held-out prompts: tau, tok/s, speedup",
             "bench"),
    "tune": ("dflash_tfm.tune", "time this GPU's tuned kernel choices for a target into the tuning cache", None),
}


def cmd_generate(args: argparse.Namespace) -> int:
    from dflash_tfm import SamplingParams
    from dflash_tfm.parallel.group import destroy_tensor_parallel, is_first_rank

    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_new_tokens=args.max_new_tokens,
        seed=args.seed, stop=args.stop or [],
    )
    engine = engine_from_args(args)
    thinking = None if args.reasoning is None else args.reasoning == "on"
    if not is_first_rank():  # under --tp-size N rank 0 leads and prints; the others decode in lockstep
        engine.follow()
        destroy_tensor_parallel()
        return 0
    print(engine.kernel_path, file=sys.stderr)
    try:
        out = engine.generate(args.prompt, params, chat=args.chat, enable_thinking=thinking)
    finally:
        engine.release_followers()
        destroy_tensor_parallel()
    print(out.text)
    s = out.stats
    print(
        f"\n[{s.completion_tokens} tokens, finish={out.finish_reason}, prefill {s.prompt_tokens} tok in "
        f"{s.prefill_seconds * 1e3:.1f} ms, decode {s.decode_tokens_per_second:.1f} tok/s, "
        f"tau={s.accept_length:.2f} over {s.verify_steps} target steps]",
        file=sys.stderr,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash-tfm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn with the chat template")
    gen.add_argument("--reasoning", choices=["on", "off"], default=None, help="Qwen thinking mode (chat only)")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    for name, (_, help_text, _) in DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    delegated = DELEGATED.get(argv[0]) if argv else None
    if delegated is not None:  # these subcommands own their flag sets
        module, _, extra = delegated
        try:
            return importlib.import_module(module).main(argv[1:]) or 0
        except ModuleNotFoundError as e:
            if extra is None or (e.name or "").startswith("dflash_tfm"):
                raise
            print(f"dflash-tfm {argv[0]}: error: needs the package {e.name!r}: pip install 'dflash-tfm[{extra}]'",
                  file=sys.stderr)
            return 2
    args = build_parser().parse_args(argv)
    from dflash_tfm.errors import CheckpointError
    from dflash_tfm.parallel.launch import launched_by_a_launcher, relaunch

    try:
        if getattr(args, "tp_size", 1) > 1 and not launched_by_a_launcher():  # start the ranks ourselves
            return relaunch(args.tp_size, "dflash_tfm.cli", argv, args.device, getattr(args, "ep_size", 1))
        return args.func(args)
    except (FileNotFoundError, CheckpointError, ValueError, NotImplementedError) as e:
        print(f"dflash-tfm {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
