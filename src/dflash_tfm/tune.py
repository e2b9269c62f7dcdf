"""`dflash-tfm tune`: time every tuned kernel choice of a target's shapes on this GPU, into the tuning cache.

The kernel choices whose winner depends on the GPU and the shape (`dflash_tfm.tuning`: the projections, the verify
attention's tiles, the Weaver's row tiles) are otherwise timed at first use, by whichever process meets a shape
first, and kept in ``<cache>/tuning/<gpu>.json`` (``<cache>``: ``$DFLASH_TFM_CACHE`` or ``~/.cache/dflash_tfm``).
This command times them all up front, anew, by running what the engine runs: a prefill, autoregressive decode
steps, and the speculative steps of DFLASH, DDTREE and DFLASH_TFM at each tree budget (draft, tree, verify,
commit). Every later process then reads its whole kernel path from the file. Entries of shapes this run does not
meet (another target's) stay; delete the file to start over.

The target: ``--model-path`` with its drafter (``--speculative-draft-model-path``) and Weaver
(``--speculative-dflash-tfm-path``), or without them the autoregressive shapes only; the embedded SmolLM2 with its
trained bundle (the default, what ``dflash-tfm generate`` runs); or ``--preset qwen3.6-27b``: the published
Qwen3.6-27B, drafter and Weaver shapes with random weights (54 GB on the GPU), what the benchmarks time.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_tfm import tuning
from dflash_tfm.config import ModelConfig
from dflash_tfm.engine.decoder_factory import build_proposer
from dflash_tfm.engine.engine import DEFAULT_MAX_MODEL_LEN
from dflash_tfm.engine.model_runner import ModelRunner
from dflash_tfm.engine.speculative import SpeculativeDecoder
from dflash_tfm.loading.default_model import DEFAULT_BUNDLE
from dflash_tfm.loading.loader import build_model, load_target
from dflash_tfm.models.presets import PUBLISHED_WEAVER, QWEN3_6_27B, QWEN3_6_27B_DFLASH
from dflash_tfm.models.random_init import init_random_
from dflash_tfm.sampling_params import SamplingParams
from dflash_tfm.spec.dflash import DFlashDrafter, load_dflash_drafter
from dflash_tfm.spec.dflash_config import DFlashConfig
from dflash_tfm.spec.weaver_fixtures import write_random_weaver_checkpoint
from dflash_tfm.speculative_config import DEFAULT_CHILDREN_PER_NODE, SpeculativeConfig

PRESETS = {"qwen3.6-27b": (QWEN3_6_27B, QWEN3_6_27B_DFLASH)}
GREEDY = SamplingParams(temperature=0.0)


@dataclass
class Target:
    """A target model's runner, and its drafter and Weaver checkpoint where the speculative steps can run."""

    runner: ModelRunner
    config: ModelConfig
    drafter: DFlashDrafter | None
    weaver_path: Path | None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-tfm tune", description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None, help="local HF directory or .gguf file (default: the embedded "
                   "SmolLM2-135M-Instruct with its bundle)")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="published shapes with random weights instead of a checkpoint")
    p.add_argument("--speculative-draft-model-path", default=None, help="the target's DFlash drafter")
    p.add_argument("--speculative-dflash-tfm-path", default=None, help="the target's Weaver checkpoint (.pth)")
    p.add_argument("--tree-budgets", type=int, nargs="+", default=[64], help="DDTREE / DFLASH_TFM budgets to tune")
    p.add_argument("--tfm-children-per-node", type=int, default=DEFAULT_CHILDREN_PER_NODE)
    p.add_argument("--max-model-len", type=int, default=None, help="as the engine will run (default: its own)")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens before the timed steps")
    p.add_argument("--steps", type=int, default=3, help="steps of each kind")
    p.add_argument("--device", default="cuda")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda" or not torch.cuda.is_available():
        print("dflash-tfm tune: error: needs a CUDA GPU (off CUDA the torch twins run and nothing is tuned)",
              file=sys.stderr)
        return 2
    if args.preset and args.model_path:
        print("dflash-tfm tune: error: give --model-path or --preset, not both", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp, tuning.retuning(device):
        target = load(args, device, Path(tmp))
        exercise(target, args.tree_budgets, args.tfm_children_per_node, args.context, args.steps)
    print(tuning.describe_kernel_path(device))
    for line in tuning.describe(device):
        print(f"  {line}")
    return 0


def load(args: argparse.Namespace, device: torch.device, tmp: Path) -> Target:
    """The target `args` name, in bfloat16 on ``device``; a random Weaver of the preset is written into ``tmp``."""
    dtype = torch.bfloat16
    if args.preset:
        target_raw, drafter_raw = PRESETS[args.preset]
        cfg = ModelConfig.from_dict(target_raw)
        max_len = args.max_model_len or min(cfg.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        model = init_random_(build_model(cfg, device, dtype, max_positions=max_len + 64))
        drafter = init_random_(DFlashDrafter(DFlashConfig.from_dict(drafter_raw), model, max_len=max_len + 64))
        weaver_path = tmp / "weaver.pth"
        write_random_weaver_checkpoint(weaver_path, cfg, K=drafter.config.block_size - 1, **PUBLISHED_WEAVER)
        return Target(ModelRunner(model, max_len, device, use_cuda_graph=False), cfg, drafter, weaver_path)
    draft_path, weaver_path = args.speculative_draft_model_path, args.speculative_dflash_tfm_path
    if args.model_path is None:
        draft_path, weaver_path = draft_path or DEFAULT_BUNDLE / "dflash", weaver_path or DEFAULT_BUNDLE / "weaver.pth"
    loaded = load_target(args.model_path, device, dtype, max_positions=args.max_model_len or DEFAULT_MAX_MODEL_LEN)
    cfg = loaded.config
    max_len = args.max_model_len or min(cfg.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
    drafter = None if draft_path is None else load_dflash_drafter(draft_path, loaded.model, cfg, device, dtype,
                                                                  max_len=max_len + 64)
    runner = ModelRunner(loaded.model, max_len, device, use_cuda_graph=False)
    return Target(runner, cfg, drafter, None if weaver_path is None else Path(weaver_path))


@torch.inference_mode()
def exercise(target: Target, budgets: list[int], children: int, context: int, steps: int) -> None:
    """Run the engine's steps over a random prompt of ``context`` tokens, each kind ``steps`` times (greedy; eager,
    so every tuned choice is timed as its shape is first met): decode, then each speculative algorithm the target
    has a drafter (and for DFLASH_TFM a Weaver) for, at each of ``budgets``."""
    runner, cfg = target.runner, target.config
    prompt = torch.randint(0, cfg.vocab_size, (context,)).tolist()
    runner.reset()
    logits, _ = runner.prefill(torch.tensor(prompt))
    token = logits.argmax().view(1)
    for position in range(context, context + steps):
        token = runner.decode(token, position).argmax(dim=-1)
    if target.drafter is None:
        return
    block = target.drafter.config.block_size
    algorithms = [("DFLASH", block)] + [("DDTREE", b) for b in budgets]
    algorithms += [("DFLASH_TFM", b) for b in budgets] if target.weaver_path is not None else []
    for algorithm, budget in algorithms:
        spec = SpeculativeConfig(algorithm, weaver_path=target.weaver_path if algorithm == "DFLASH_TFM" else None,
                                 tree_budget=budget, children_per_node=children)
        proposer = build_proposer(spec, runner, cfg, block)
        decoder = SpeculativeDecoder(runner, target.drafter, proposer)
        decoder.prefill(prompt, GREEDY, None)
        for _ in range(steps):
            decoder.step(GREEDY, None)


if __name__ == "__main__":
    sys.exit(main())
