"""The checkpoint errors' old address, still imported by `dflash_tfm.cli`: they live in `dflash_tfm.errors` (the
ground floor, so that `config` can raise them without importing `loading`)."""
from dflash_tfm.errors import CheckpointError, CheckpointNotFoundError

__all__ = ["CheckpointError", "CheckpointNotFoundError"]
