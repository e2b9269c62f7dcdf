"""SpeculativeConfig: one place for the speculative settings' defaults, validation and flags."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from dflash_tfm.speculative_config import (DEFAULT_CHILDREN_PER_NODE, DEFAULT_TREE_BUDGET, SpeculativeConfig,
                                           SpeculativeConfigError, add_speculative_args, speculative_config_from_args,
                                           unused_speculative_flags)


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_speculative_args(p)
    return p.parse_args(list(argv))


def test_defaults_and_normalisation() -> None:
    spec = SpeculativeConfig()
    assert not spec.enabled and spec.tree_budget == DEFAULT_TREE_BUDGET
    assert spec.children_per_node == DEFAULT_CHILDREN_PER_NODE
    assert SpeculativeConfig("none").algorithm is None and SpeculativeConfig("ddtree").algorithm == "DDTREE"
    assert speculative_config_from_args(parse()) == SpeculativeConfig()


@pytest.mark.parametrize("kwargs,message", [
    (dict(algorithm="EAGLE"), "unknown algorithm (--speculative-algorithm) 'EAGLE'"),
    (dict(algorithm="DDTREE", tree_budget=0), "tree_budget (--speculative-tree-budget) must be an integer >= 1"),
    (dict(algorithm="DDTREE", tree_budget="big"), "or 'auto', got 'big'"),
    (dict(algorithm="DFLASH_TFM", children_per_node=0), "children_per_node"),
    (dict(algorithm="DFLASH", block_size=1), "block_size (--speculative-dflash-block-size) must be >= 2"),
    (dict(algorithm="DFLASH", gdn_verify_kernel="fast"), "must be one of chunk, recurrent"),
    (dict(algorithm="DDTREE", weaver_path="/w.pth"), "only used by DFLASH_TFM, not DDTREE"),
])
def test_invalid_settings_name_field_and_flag(kwargs: dict, message: str) -> None:
    with pytest.raises(SpeculativeConfigError) as e:
        SpeculativeConfig(**kwargs)
    assert message in str(e.value)


def test_checkpoints_from_bundle_or_required(tmp_path: Path) -> None:
    spec = SpeculativeConfig("DFLASH_TFM").with_checkpoints(tmp_path)
    assert (spec.draft_model_path, spec.weaver_path) == (tmp_path / "dflash", tmp_path / "weaver.pth")
    assert SpeculativeConfig("DDTREE").with_checkpoints(tmp_path).weaver_path is None
    with pytest.raises(SpeculativeConfigError, match="needs draft_model_path"):
        SpeculativeConfig("DFLASH").with_checkpoints()
    with pytest.raises(SpeculativeConfigError, match="needs weaver_path"):
        SpeculativeConfig("DFLASH_TFM", draft_model_path="/d").with_checkpoints()


def test_budget_flag_takes_auto_or_a_number(capsys) -> None:
    assert speculative_config_from_args(parse("--speculative-algorithm", "DDTREE")).tree_budget == "auto"
    assert speculative_config_from_args(parse("--speculative-algorithm", "DDTREE", "--speculative-tree-budget",
                                              "AUTO")).adaptive
    with pytest.raises(SystemExit):
        parse("--speculative-tree-budget", "lots")
    assert "expected 'auto' or an integer" in capsys.readouterr().err


def test_flags_both_budget_spellings_and_unused_ones() -> None:
    for flag in ("--speculative-tree-budget", "--speculative-dflash-tfm-tree-budget"):
        spec = speculative_config_from_args(parse("--speculative-algorithm", "ddtree", flag, "32"))
        assert spec.tree_budget == 32 and spec.algorithm == "DDTREE"
    ns = parse("--speculative-algorithm", "DFLASH", "--speculative-tree-budget", "8",
               "--speculative-dflash-tfm-children-per-node", "4")
    assert set(unused_speculative_flags(ns, speculative_config_from_args(ns))) == {
        "--speculative-tree-budget=8", "--speculative-dflash-tfm-children-per-node=4"}
    with pytest.raises(SpeculativeConfigError, match="given without --speculative-algorithm"):
        speculative_config_from_args(parse("--speculative-tree-budget", "8"))


def test_describe_names_files_not_paths() -> None:
    info = SpeculativeConfig("DFLASH_TFM", "/models/drafter", "/models/w.pth", block_size=16).describe()
    assert info["speculative_draft_model"] == "drafter" and info["speculative_dflash_tfm_model"] == "w.pth"
    assert info["speculative_tree_budget"] == DEFAULT_TREE_BUDGET
    assert SpeculativeConfig("DFLASH", "/d", tree_budget=8).describe()["speculative_tree_budget"] is None
    assert SpeculativeConfig("DFLASH", "/d").describe()["speculative_tree_budget"] == "auto"  # adapts the chain
