"""Shared test setup: CPU by default; tests marked `gpu` are skipped without CUDA; the tuning cache in a temporary
directory, never the user's."""
import pytest
import torch

from dflash_tfm import tuning


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu_check.sh on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session", autouse=True)
def tuning_cache(tmp_path_factory):
    """Kernel choices timed by GPU tests go to a directory of this session (`dflash_tfm.tuning`)."""
    tuning.use_directory(tmp_path_factory.mktemp("tuning"))
    yield
    tuning.use_directory(None)
