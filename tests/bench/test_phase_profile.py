"""bench_spec_step --profile runs the step's phases eagerly one by one: the decode it interrupts stays exact."""
from __future__ import annotations

import torch

from benchmarks.bench_spec_step import profile_phases
from dflash_tfm.engine.decoder_factory import build_decoder
from tests import spec_config
from tests.spec.test_speculative_decoding import GREEDY, N_TOKENS, PROMPT, greedy_reference, runner_for, target  # noqa: F401


def test_profiled_steps_continue_the_greedy_decode(target, capsys) -> None:  # noqa: F811
    cfg, model, root = target
    decoder = build_decoder(runner_for(model), cfg, spec_config("DFLASH_TFM", root, 16))
    tokens = [decoder.prefill(PROMPT, GREEDY, None)] + decoder.step(GREEDY, None)
    with torch.inference_mode():
        tokens += profile_phases(decoder, GREEDY, "tiny", steps=2)
    while len(tokens) < N_TOKENS:
        tokens += decoder.step(GREEDY, None)
    assert tokens[:N_TOKENS] == greedy_reference(model)
    tables = capsys.readouterr().out
    assert all(f"tiny, {phase}:" in tables for phase in ("draft", "tree", "verify", "commit"))
