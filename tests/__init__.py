"""Helpers shared by the test packages."""
from __future__ import annotations

from pathlib import Path

from dflash_tfm.speculative_config import SpeculativeConfig


def spec_config(algorithm: str, root: Path, budget: int = 64, **kwargs) -> SpeculativeConfig:
    """The config of `algorithm` over checkpoints laid out as the bundle is (`root/dflash`, `root/weaver.pth`);
    the Weaver only where the algorithm uses one."""
    weaver = root / "weaver.pth" if algorithm == "DFLASH_TFM" else None
    return SpeculativeConfig(algorithm, root / "dflash", weaver, budget, **kwargs)
