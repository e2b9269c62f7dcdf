"""Shared test setup: CPU by default; tests marked `gpu` are skipped without CUDA."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu_check.sh on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
