import pytest

from dflash_tfm import Engine


@pytest.fixture(scope="session")
def smollm2() -> Engine:
    """The embedded SmolLM2-135M-Instruct on the CPU in fp32, context 512 (loaded once per test session)."""
    return Engine(device="cpu", dtype="float32", max_model_len=512, progress=False)
