"""Plain autoregressive decoding: one target step (a CUDA-graph replay on GPU) per token."""
from __future__ import annotations

import torch

from dflash_tfm.engine.model_runner import ModelRunner
from dflash_tfm.sampling import sample
from dflash_tfm.sampling_params import SamplingParams


class AutoregressiveDecoder:
    """Same interface as SpeculativeDecoder: `prefill` returns the first token, `step` the next tokens."""

    last_step_drafts = 0  # tokens the last step proposed for verification: none

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.token: torch.Tensor | None = None
        self.position = 0

    def prefill(self, prompt_ids: list[int], params: SamplingParams, generator: torch.Generator | None) -> int:
        self.runner.reset()
        logits, _ = self.runner.prefill(torch.tensor(prompt_ids, dtype=torch.long))
        self.position = len(prompt_ids)
        self.token = sample(logits.view(1, -1), params, generator)
        return int(self.token.item())

    def step(self, params: SamplingParams, generator: torch.Generator | None) -> list[int]:
        logits = self.runner.decode(self.token, self.position)
        self.position += 1
        self.token = sample(logits, params, generator)
        return [int(self.token.item())]

    def phase_seconds(self) -> dict[str, float]:
        return {}

    def expected_drafts(self) -> float | None:
        return None  # nothing is drafted
