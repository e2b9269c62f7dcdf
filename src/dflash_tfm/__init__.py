"""dflash-tfm: tree speculative decoding (DFlash drafter + Weaver trees + rollback-free tree verification)."""
from dflash_tfm.engine.engine import Engine
from dflash_tfm.engine.result import GenerationResult, GenerationStats
from dflash_tfm.sampling_params import SamplingParams

__all__ = ["Engine", "GenerationResult", "GenerationStats", "SamplingParams"]
__version__ = "0.1.0"
