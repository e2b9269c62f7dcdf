"""The embedded real model, SmolLM2-135M-Instruct (Q4_1 GGUF), against `transformers` greedy generation.

Both load the same GGUF file (transformers dequantises it itself), run in fp32 on the CPU, and must produce
the same tokens, token for token, for >= 64 new tokens on several chat prompts.
"""
from __future__ import annotations

import pytest
import torch

from dflash_tfm import Engine, SamplingParams
from dflash_tfm.loading.default_model import default_model_path

PROMPTS = [
    "What is the capital of France? Answer in one paragraph with some history.",
    "Write a short poem about the sea.",
    "Explain step by step: Natalia sold clips to 48 of her friends in April, and then she sold half as many "
    "clips in May. How many clips did Natalia sell altogether in April and May?",
    "Write a Python function that returns the n-th Fibonacci number.",
]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(device="cpu", dtype="float32", progress=False)


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    # Neither side stops at EOS, so every prompt compares exactly NEW_TOKENS greedy tokens.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_matches_transformers(engine: Engine, hf_model, prompt: str) -> None:
    ids = engine.apply_chat_template([{"role": "user", "content": prompt}])
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids):].tolist()
    out = engine.generate(ids, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    assert out.token_ids == ref
    assert len(out.token_ids) == NEW_TOKENS
    assert out.stats.completion_tokens == NEW_TOKENS
