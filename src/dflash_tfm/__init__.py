"""dflash-tfm: tree speculative decoding (DFlash drafter + Weaver trees + rollback-free tree verification).

`Engine` is imported lazily so light entry points (the benchmark client, `--help`) do not load torch models.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["Engine", "GenerationResult", "GenerationStats", "SamplingParams", "SpeculativeConfig"]

if TYPE_CHECKING:
    from dflash_tfm.engine.engine import Engine
    from dflash_tfm.engine.result import GenerationResult, GenerationStats
    from dflash_tfm.sampling_params import SamplingParams
    from dflash_tfm.speculative_config import SpeculativeConfig


def __getattr__(name: str):
    if name == "Engine":
        from dflash_tfm.engine.engine import Engine

        return Engine
    if name in ("GenerationResult", "GenerationStats"):
        from dflash_tfm.engine import result

        return getattr(result, name)
    if name == "SamplingParams":
        from dflash_tfm.sampling_params import SamplingParams

        return SamplingParams
    if name == "SpeculativeConfig":
        from dflash_tfm.speculative_config import SpeculativeConfig

        return SpeculativeConfig
    raise AttributeError(f"module 'dflash_tfm' has no attribute {name!r}")
