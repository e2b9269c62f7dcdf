"""Errors raised while locating and reading checkpoints.

One exception family so callers (CLI, server) can turn any bad-checkpoint problem into a one-line
message instead of a traceback from deep inside a parser.
"""


class CheckpointError(ValueError):
    """A checkpoint exists but cannot be used: corrupt, truncated, or an unsupported layout."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A checkpoint file is missing; also a `FileNotFoundError` so generic handlers catch it."""
