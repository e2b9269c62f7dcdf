"""An engine's speculative-decoding settings: their defaults, validation and command-line flags, written once.

`Engine`, `dflash-tfm generate`, the demo and the server all build a `SpeculativeConfig`; the flags
(`add_speculative_args` / `speculative_config_from_args`) keep the original system's spellings, so published
launch commands run unchanged. Messages name both the field and its flag, so they read right from Python
and from a shell.

    algorithm           None (autoregressive), DFLASH (the drafter's chain), DDTREE (best-first tree over the
                        drafter's marginals) or DFLASH_TFM (Weaver-grown tree)
    draft_model_path    the DFlash drafter directory (z-lab format)
    weaver_path         the Weaver .pth checkpoint (DFLASH_TFM only)
    tree_budget         draft nodes per tree (DDTREE, DFLASH_TFM; a tree of budget + 1 nodes is verified), or "auto":
                        every step picks the size that maximises expected tokens per second from sizes measured
                        on this machine (engine/budget.py), 0 (a plain decode step) included; for DFLASH, "auto"
                        picks the chain's length the same way
    children_per_node   children a DFLASH_TFM node publishes when Weaver expands it
    block_size          must equal the drafter's own block size when given (drafters are trained for one)
    gdn_verify_kernel   the Gated-DeltaNet tree solve: "chunk" (one chunked solve) or "recurrent" (per node)
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from pathlib import Path

ALGORITHMS = ("DFLASH", "DDTREE", "DFLASH_TFM")
TREE_ALGORITHMS = ("DDTREE", "DFLASH_TFM")
GDN_VERIFY_KERNELS = ("chunk", "recurrent")
AUTO = "auto"
DEFAULT_TREE_BUDGET = AUTO
# Children an expanded node publishes. The published system uses 8; 16 measured better here: the exact expected
# accept length over the same states (benchmarks/tree_expectation.py, docs/TRAINING.md) rose at T = 1 on all
# four prompt sets (+0.06 … +0.39 per step) and never fell at T = 0. 8 stays selectable.
DEFAULT_CHILDREN_PER_NODE = 16

FLAGS = {  # field -> its command-line flag
    "algorithm": "--speculative-algorithm",
    "draft_model_path": "--speculative-draft-model-path",
    "weaver_path": "--speculative-dflash-tfm-path",
    "tree_budget": "--speculative-tree-budget",
    "children_per_node": "--speculative-dflash-tfm-children-per-node",
    "block_size": "--speculative-dflash-block-size",
    "gdn_verify_kernel": "--speculative-gdn-verify-kernel",
}


class SpeculativeConfigError(ValueError):
    """Settings that cannot work together; the message names the field and its flag."""


def _name(field: str) -> str:
    return f"{field} ({FLAGS[field]})"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def tree_budget_arg(text: str) -> int | str:
    """The budget flag's value: "auto" or a positive integer."""
    if text.lower() == AUTO:
        return AUTO
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or an integer, got {text!r}") from None


@dataclass(frozen=True)
class SpeculativeConfig:
    algorithm: str | None = None
    draft_model_path: str | Path | None = None
    weaver_path: str | Path | None = None
    tree_budget: int | str = DEFAULT_TREE_BUDGET
    children_per_node: int = DEFAULT_CHILDREN_PER_NODE
    block_size: int | None = None
    gdn_verify_kernel: str = "chunk"

    def __post_init__(self) -> None:
        algo = None if self.algorithm is None or str(self.algorithm).upper() == "NONE" else str(self.algorithm).upper()
        if algo is not None and algo not in ALGORITHMS:
            raise SpeculativeConfigError(
                f"unknown {_name('algorithm')} {self.algorithm!r}; choose NONE or one of {', '.join(ALGORITHMS)}")
        object.__setattr__(self, "algorithm", algo)
        if self.tree_budget != AUTO and (not _is_int(self.tree_budget) or self.tree_budget < 1):
            raise SpeculativeConfigError(f"{_name('tree_budget')} must be an integer >= 1 or 'auto', "
                                         f"got {self.tree_budget!r}")
        if not _is_int(self.children_per_node) or self.children_per_node < 1:
            raise SpeculativeConfigError(f"{_name('children_per_node')} must be an integer >= 1, "
                                         f"got {self.children_per_node!r}")
        if self.block_size is not None and (not isinstance(self.block_size, int) or self.block_size < 2):
            raise SpeculativeConfigError(
                f"{_name('block_size')} must be >= 2 (the root and at least one draft), got {self.block_size!r}")
        if self.gdn_verify_kernel not in GDN_VERIFY_KERNELS:
            raise SpeculativeConfigError(f"{_name('gdn_verify_kernel')} must be one of {', '.join(GDN_VERIFY_KERNELS)}, "
                                         f"got {self.gdn_verify_kernel!r}")
        if algo in ("DFLASH", "DDTREE") and self.weaver_path is not None:
            raise SpeculativeConfigError(f"{_name('weaver_path')} (Weaver) is only used by DFLASH_TFM, not {algo}; "
                                         "drop it or use DFLASH_TFM")

    @property
    def enabled(self) -> bool:
        return self.algorithm is not None

    @property
    def uses_tree_budget(self) -> bool:
        """Whether the algorithm reads tree_budget: the tree algorithms, and DFLASH when it is "auto"."""
        return self.algorithm in TREE_ALGORITHMS or (self.algorithm == "DFLASH" and self.adaptive)

    @property
    def adaptive(self) -> bool:
        return self.tree_budget == AUTO

    def with_checkpoints(self, bundle: Path | None = None) -> SpeculativeConfig:
        """The config with its checkpoint paths required: missing ones are taken from `bundle` (a directory
        holding `dflash/` and `weaver.pth`, given when the target is the embedded default the bundle was trained
        for), else an error naming the flag."""
        if not self.enabled:
            return self
        spec = self
        if bundle is not None:
            spec = replace(spec, draft_model_path=spec.draft_model_path or bundle / "dflash",
                           weaver_path=spec.weaver_path or (bundle / "weaver.pth" if spec.algorithm == "DFLASH_TFM" else None))
        if spec.draft_model_path is None:
            raise SpeculativeConfigError(f"{_name('algorithm')} {spec.algorithm} needs {_name('draft_model_path')}, "
                                         "the DFlash drafter directory")
        if spec.algorithm == "DFLASH_TFM" and spec.weaver_path is None:
            raise SpeculativeConfigError(f"{_name('algorithm')} DFLASH_TFM needs {_name('weaver_path')}, "
                                         "the Weaver checkpoint")
        return spec

    def describe(self) -> dict[str, object]:
        """The settings that apply, for logs and /get_model_info: checkpoint paths by file name only, values an
        algorithm does not use as None."""
        return {
            "speculative_algorithm": self.algorithm,
            "speculative_draft_model": Path(self.draft_model_path).name if self.draft_model_path else None,
            "speculative_dflash_tfm_model": Path(self.weaver_path).name if self.weaver_path else None,
            "speculative_dflash_block_size": self.block_size if self.enabled else None,
            "speculative_tree_budget": self.tree_budget if self.uses_tree_budget else None,
            "speculative_dflash_tfm_children_per_node": (
                self.children_per_node if self.algorithm == "DFLASH_TFM" else None),
            "speculative_gdn_verify_kernel": self.gdn_verify_kernel if self.enabled else None,
        }


# ---- command-line flags ------------------------------------------------------------------------------------

def add_speculative_args(p: argparse.ArgumentParser) -> None:
    """The speculative flags. Value flags default to None ("not given"), so a flag given without an algorithm
    is refused instead of silently ignored."""
    p.add_argument("--speculative-algorithm", default=None, type=str.upper, choices=["NONE", *ALGORITHMS])
    p.add_argument("--speculative-draft-model-path", default=None, help="the DFlash drafter directory")
    p.add_argument("--speculative-dflash-tfm-path", default=None, help="the Weaver checkpoint (.pth), DFLASH_TFM only")
    p.add_argument("--speculative-tree-budget", "--speculative-dflash-tfm-tree-budget", dest="speculative_tree_budget",
                   type=tree_budget_arg, default=None,
                   help="draft nodes per tree (DDTREE, DFLASH_TFM), or 'auto' (the default): each step picks the size "
                        "that maximises expected tokens per second on this machine, a plain decode step included; "
                        "for DFLASH, 'auto' adapts the chain's length")
    p.add_argument("--speculative-dflash-tfm-children-per-node", type=int, default=None,
                   help=f"children a DFLASH_TFM node publishes per Weaver expansion (default {DEFAULT_CHILDREN_PER_NODE}; "
                        "the published system: 8)")
    p.add_argument("--speculative-dflash-block-size", type=int, default=None, help="default: the drafter's own")
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                   help="draft tokens per step; must equal --speculative-dflash-block-size (sets it when given alone)")
    p.add_argument("--speculative-gdn-verify-kernel", default=None, choices=list(GDN_VERIFY_KERNELS),
                   help="Gated-DeltaNet tree solve (default chunk)")


_VALUE_DESTS = {  # namespace dest -> config field
    "speculative_draft_model_path": "draft_model_path",
    "speculative_dflash_tfm_path": "weaver_path",
    "speculative_tree_budget": "tree_budget",
    "speculative_dflash_tfm_children_per_node": "children_per_node",
    "speculative_dflash_block_size": "block_size",
    "speculative_gdn_verify_kernel": "gdn_verify_kernel",
}


def speculative_config_from_args(ns: argparse.Namespace) -> SpeculativeConfig:
    """The config the flags describe; SpeculativeConfigError names the offending flags."""
    algo = None if ns.speculative_algorithm in (None, "NONE") else ns.speculative_algorithm
    given = {dest: getattr(ns, dest) for dest in (*_VALUE_DESTS, "speculative_num_draft_tokens")
             if getattr(ns, dest) is not None}
    if algo is None and given:
        flags = ", ".join(FLAGS.get(_VALUE_DESTS.get(d, ""), "--" + d.replace("_", "-")) for d in given)
        raise SpeculativeConfigError(f"{flags} given without --speculative-algorithm (DFLASH, DDTREE or DFLASH_TFM)")
    block, n_draft = ns.speculative_dflash_block_size, ns.speculative_num_draft_tokens
    if n_draft is not None:
        if block is not None and block != n_draft:
            raise SpeculativeConfigError(
                f"--speculative-num-draft-tokens {n_draft} differs from --speculative-dflash-block-size {block}: "
                "a DFlash step drafts one block, give one value")
        given["speculative_dflash_block_size"] = n_draft
    given.pop("speculative_num_draft_tokens", None)
    return SpeculativeConfig(algo, **{_VALUE_DESTS[d]: v for d, v in given.items()})


def unused_speculative_flags(ns: argparse.Namespace, spec: SpeculativeConfig) -> dict[str, str]:
    """Flags given that the chosen algorithm does not use (flag=value -> why), to be logged, not refused:
    launch scripts often pass one flag set to every algorithm."""
    unused = {}
    if ns.speculative_tree_budget is not None and spec.enabled and not spec.uses_tree_budget:
        unused[f"{FLAGS['tree_budget']}={ns.speculative_tree_budget}"] = (
            f"{spec.algorithm} verifies its whole chain; only 'auto' adapts its length")
    children = ns.speculative_dflash_tfm_children_per_node
    if children is not None and spec.algorithm in ("DFLASH", "DDTREE"):
        unused[f"{FLAGS['children_per_node']}={children}"] = f"{spec.algorithm} grows no Weaver tree"
    return unused
