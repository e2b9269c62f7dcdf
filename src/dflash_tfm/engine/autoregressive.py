"""Plain autoregressive decoding: one target step (a CUDA-graph replay on GPU) per token.

On CUDA the decoder runs one step ahead of its caller, as the speculative decoder does: the sampled token stays on
the device as the next step's input, so once a token is read the next step is enqueued before the token is handed
back, and the GPU decodes while the host detokenises and streams.
"""
from __future__ import annotations

import torch

from dflash_tfm.engine.model_runner import ModelRunner
from dflash_tfm.sampling import sample
from dflash_tfm.sampling_params import SamplingParams


class AutoregressiveDecoder:
    """Same interface as SpeculativeDecoder: `prefill` returns the first token, `step` the next tokens."""

    last_step_drafts = 0  # tokens the last step proposed for verification: none

    def __init__(self, runner: ModelRunner, run_ahead: bool | None = None) -> None:
        """run_ahead: enqueue each step before the previous token is returned (default: on CUDA; on the CPU every
        op is synchronous, so it would only delay the tokens)."""
        self.runner = runner
        cuda = runner.device.type == "cuda"
        self.run_ahead = cuda if run_ahead is None else run_ahead
        self.token: torch.Tensor | None = None  # the last sampled token, on the device
        self.position = 0  # where the next decode step writes
        self._in_flight = False  # a step is enqueued whose token is not read yet
        self._token_host = torch.empty(1, dtype=torch.long, pin_memory=cuda)
        self._token_copied = torch.cuda.Event() if cuda else None

    def prefill(self, prompt_ids: list[int], params: SamplingParams, generator: torch.Generator | None) -> int:
        self._in_flight = False  # a step run ahead of the last request: its work is ordered before the reset
        self.runner.reset()
        logits, _ = self.runner.prefill(torch.tensor(prompt_ids, dtype=torch.long))
        self.position = len(prompt_ids)
        self.token = sample(logits.view(1, -1), params, generator)
        return int(self.token.item())

    def step(self, params: SamplingParams, generator: torch.Generator | None) -> list[int]:
        if not self._in_flight:
            self._launch(params, generator)
        token = self._finish()
        if self.run_ahead and self.position < self.runner.max_len:
            self._launch(params, generator)
        return [token]

    def _launch(self, params: SamplingParams, generator: torch.Generator | None) -> None:
        logits = self.runner.decode(self.token, self.position)
        self.position += 1
        self.token = sample(logits, params, generator)
        self._token_host.copy_(self.token, non_blocking=self._token_copied is not None)
        if self._token_copied is not None:
            self._token_copied.record()
        self._in_flight = True

    def _finish(self) -> int:
        if self._token_copied is not None:
            self._token_copied.synchronize()
        self._in_flight = False
        return int(self._token_host[0])

    def phase_seconds(self) -> dict[str, float]:
        return {}

    def expected_drafts(self) -> float | None:
        return None  # nothing is drafted
