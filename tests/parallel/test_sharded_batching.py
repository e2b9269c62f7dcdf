"""Continuous batching with the target split over 2 gloo ranks: rank 0 admits, steps and aborts; the other rank
follows (`Engine.follow`), applying the same admissions and aborts before each step. Every request's tokens
equal the tp 1 engine's: greedy and seeded-sampled requests, one joining mid-run, one aborted mid-run, and a
sampled request without a seed, which rank 0 seeds so that both ranks draw alike. Autoregressive and
speculative (DDTREE, a random drafter replicated on both ranks) batches, at a fixed budget and at 'auto', whose
per-bucket budgets must choose the same size on both ranks (rank 0's measured step times) or their collectives
would not meet; there the greedy requests are compared (sizes may differ from the tp 1 engine's, which moves
which uniform a sampled draw takes)."""
from __future__ import annotations

import pytest

from dflash_tfm import Engine, SamplingParams, SpeculativeConfig
from dflash_tfm.config import ModelConfig
from dflash_tfm.loading.loader import open_checkpoint
from dflash_tfm.spec.fixtures import write_random_dflash_checkpoint

from ..train.tiny_chat import save_tiny_chat_model
from .ranks import run_ranks

PROMPTS = {"a": [1, 7, 9, 12, 20], "b": [1, 5, 6, 7, 8, 9, 10], "c": [3, 4], "d": [2, 9, 9, 4, 1, 30]}


def script(engine: Engine) -> dict[str, list[int]]:
    """a, b, d from the start (d sampled with a seed, b without), c after 3 steps, b aborted after 5."""
    tokens: dict[str, list[int]] = {name: [] for name in PROMPTS}
    params = {"a": SamplingParams(max_new_tokens=12), "b": SamplingParams(temperature=1.0, max_new_tokens=30),
              "c": SamplingParams(max_new_tokens=10), "d": SamplingParams(temperature=0.8, seed=3, max_new_tokens=16)}
    names = {}
    for name in "abd":
        names[engine.add_request(PROMPTS[name], params[name])] = name
    steps = 0
    while names:
        if steps == 3:
            names[engine.add_request(PROMPTS["c"], params["c"])] = "c"
        if steps == 5:
            aborted = next(seq for seq, name in names.items() if name == "b")
            engine.abort_request(aborted)
            del names[aborted]
        for seq, delta in engine.step():
            if seq in names:
                tokens[names[seq]] += delta.token_ids
                if seq.finished:
                    del names[seq]
        steps += 1
    return tokens


def batched(rank: int, tp: int, path: str, spec: SpeculativeConfig | None) -> dict[str, list[int]] | None:
    engine = Engine(path, spec, device="cpu", dtype="float32", max_model_len=128, progress=False, tp_size=tp,
                    max_running_requests=4)
    if rank:
        engine.follow()
        return None
    try:
        return script(engine)
    finally:
        engine.release_followers()


@pytest.mark.parametrize("budget", [None, 12, "auto"], ids=["autoregressive", "DDTREE", "DDTREE-auto"])
def test_tp2_batched_requests_equal_tp1(tmp_path, budget: int | str | None) -> None:
    path = save_tiny_chat_model(tmp_path)
    spec = None
    if budget is not None:
        cfg = ModelConfig.from_dict(open_checkpoint(path)[1])
        drafter = write_random_dflash_checkpoint(tmp_path / "dflash", cfg, num_layers=1, block_size=8,
                                                 target_layer_ids=[0, cfg.num_layers - 1])
        spec = SpeculativeConfig("DDTREE", drafter, tree_budget=budget)
    speculative = spec is not None
    single = script(Engine(str(path), spec, device="cpu", dtype="float32", max_model_len=128, progress=False,
                           max_running_requests=4))
    split = run_ranks(2, batched, str(path), spec)
    assert split[1] is None
    for name in "ac" if budget == "auto" else "acd":
        assert split[0][name] == single[name] and single[name], name
    assert len(single["a"]) == 12 and len(single["c"]) == 10
    if not speculative:  # aborted after 5 steps (of one token each); b's seed differs between runs
        assert len(split[0]["b"]) == 5 == len(single["b"])


def measured_times(rank: int, tp: int, path: str, spec: SpeculativeConfig) -> dict:
    engine = Engine(path, spec, device="cpu", dtype="float32", max_model_len=128, progress=False, tp_size=tp,
                    max_running_requests=4)
    times = {bucket: dict(budget.measured_seconds) for bucket, budget in engine.batch.budgets.items()}
    if rank:
        engine.follow()
    else:
        engine.release_followers()
    return times


def test_tp2_batch_budgets_decide_with_rank_0s_step_times(tmp_path) -> None:
    """Each rank times the steps itself (never to the same nanosecond), so only rank 0's times, sent to the
    others, make their budgets choose alike."""
    path = save_tiny_chat_model(tmp_path)
    cfg = ModelConfig.from_dict(open_checkpoint(path)[1])
    drafter = write_random_dflash_checkpoint(tmp_path / "dflash", cfg, num_layers=1, block_size=8,
                                             target_layer_ids=[0, cfg.num_layers - 1])
    times = run_ranks(2, measured_times, str(path), SpeculativeConfig("DDTREE", drafter, tree_budget="auto"))
    assert times[0] == times[1] and sorted(times[0]) == [1, 2, 4]
