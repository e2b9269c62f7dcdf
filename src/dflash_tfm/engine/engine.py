"""`Engine`: the facade users, the CLI and the server call. One sequence at a time (batch 1).

    from dflash_tfm import Engine, SamplingParams, SpeculativeConfig
    engine = Engine()                      # embedded SmolLM2-135M-Instruct, autoregressive
    engine = Engine(speculative=SpeculativeConfig("DFLASH_TFM"))   # with the bundle trained for it
    out = engine.generate("Hello", SamplingParams(max_new_tokens=32))
    print(out.text, out.stats.accept_length)
"""
from __future__ import annotations

import functools
import random
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator

import torch

from dflash_tfm import tuning
from dflash_tfm.engine.decoder_factory import build_decoder
from dflash_tfm.engine.detokenizer import IncrementalDetokenizer
from dflash_tfm.engine.model_runner import ModelRunner
from dflash_tfm.engine.result import GenerationResult, GenerationStats
from dflash_tfm.loading.default_model import DEFAULT_BUNDLE
from dflash_tfm.loading.loader import load_target, parse_dtype
from dflash_tfm.parallel.group import broadcast_object, init_tensor_parallel, tp_rank, tp_size as group_size
from dflash_tfm.parallel.sharding import Shard
from dflash_tfm.sampling import make_generator
from dflash_tfm.sampling_params import SamplingParams
from dflash_tfm.speculative_config import SpeculativeConfig

DEFAULT_MAX_MODEL_LEN = 32768

Prompt = str | list[int] | list[dict]


@dataclass
class StreamDelta:
    """Incremental output: new token ids and new text since the last delta; `finish_reason` on the last one."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stats: GenerationStats = field(default_factory=GenerationStats)


class Engine:
    def __init__(
        self,
        model_path: str | Path | None = None,
        speculative: SpeculativeConfig | None = None,
        *,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype = "auto",
        quantization: str | None = None,
        max_model_len: int | None = None,
        use_cuda_graph: bool = True,
        progress: bool = True,
        tp_size: int = 1,
    ) -> None:
        """model_path None = the embedded SmolLM2-135M-Instruct; then a speculative config without checkpoint
        paths uses the bundle trained for it (loading.default_model.DEFAULT_BUNDLE).
        dtype "auto" = bfloat16 on CUDA and float32 on the CPU (CPU bf16 matmuls are slow and inexact).
        quantization "fp8" holds a BF16 checkpoint's projections in FP8 (loading/fp8_layout.py); FP8 checkpoints
        load as FP8 either way.
        max_model_len defaults to min(the model's context, 32768) and sizes the static caches.
        `self.speculative` is the config as run: checkpoint paths filled in, block_size the drafter's own.
        tp_size > 1 splits the target over that many processes (`parallel/`), each of which builds this Engine
        (started by torchrun): the drafter and Weaver are replicated, so every rank builds the same tree and
        accepts the same tokens, and only the target's projections communicate."""
        speculative = (speculative or SpeculativeConfig()).with_checkpoints(DEFAULT_BUNDLE if model_path is None else None)
        self.device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' requested but CUDA is not available")
        self.device = init_tensor_parallel(tp_size, self.device.type) if tp_size > 1 else self.device
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # events, streams and graph captures act on the current device
        if dtype == "auto":
            dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.dtype = parse_dtype(dtype)
        # RoPE tables only need the positions the caches can hold (not e.g. Qwen3.6's 262144).
        loaded = load_target(model_path, self.device, self.dtype, max_positions=max_model_len or DEFAULT_MAX_MODEL_LEN,
                             progress=progress, quantization=quantization, shard=Shard(tp_rank(), tp_size))
        self.config, self.tokenizer, self.model_path = loaded.config, loaded.tokenizer, loaded.source_path
        limit = min(self.config.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        self.max_model_len = int(max_model_len or limit)
        if not 1 < self.max_model_len <= self.config.max_position_embeddings:
            raise ValueError(
                f"max_model_len must be in [2, {self.config.max_position_embeddings}], got {self.max_model_len}"
            )
        self.runner = ModelRunner(loaded.model, self.max_model_len, self.device, use_cuda_graph=use_cuda_graph)
        self.decoder = build_decoder(self.runner, self.config, speculative)
        block = getattr(self.decoder, "block", None)
        self.speculative = replace(speculative, block_size=block) if speculative.enabled else speculative
        self.eos_token_ids = set(self.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(int(self.tokenizer.eos_token_id))

    @property
    def speculative_algorithm(self) -> str | None:
        return self.speculative.algorithm

    @property
    def budget_step_ms(self) -> dict[int, float] | None:
        """An adaptive budget's candidate proposal sizes and their measured step times in ms (None: a fixed
        budget, or autoregressive decoding)."""
        budget = getattr(self.decoder, "budget", None)
        return None if budget is None else {b: 1e3 * t for b, t in sorted(budget.step_seconds.items())}

    @property
    def kernel_path(self) -> str:
        """One line naming the kernel choices this process takes (the tuning cache file and its table hash on a
        GPU): printed at start by the CLI, the demo and the server, so two runs can be seen to take one path."""
        return tuning.describe_kernel_path(self.device)

    @functools.cached_property
    def max_chars_per_token(self) -> int:
        """The most characters one token can stand for (its longest vocabulary entry: byte-level and
        SentencePiece entries spell at least one character per decoded character). A text longer than
        max_model_len times this cannot fit the context, which is known without tokenizing it."""
        return max(1, max((len(t) for t in self.tokenizer.get_vocab()), default=1))

    # ---- prompts -------------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], enable_thinking: bool | None = None) -> list[int]:
        """Token ids of a chat with the generation prompt appended; `enable_thinking` is passed to
        templates that read it (Qwen reasoning on/off) and ignored by others."""
        kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def encode_prompt(self, prompt: Prompt, chat: bool = False, enable_thinking: bool | None = None) -> list[int]:
        """str (raw text, or a single user turn when chat=True), list of messages, or token ids -> token ids."""
        if isinstance(prompt, str):
            if chat:
                return self.apply_chat_template([{"role": "user", "content": prompt}], enable_thinking)
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        if prompt and all(isinstance(m, dict) for m in prompt):
            return self.apply_chat_template(prompt, enable_thinking)  # type: ignore[arg-type]
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError("prompt must be a string, a list of chat messages, or a list of token ids")
        bad = [t for t in prompt if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.config.vocab_size}): {bad[:8]}")
        return list(prompt)  # type: ignore[arg-type]

    # ---- generation ----------------------------------------------------------------------------------
    def generate(
        self, prompt: Prompt, params: SamplingParams | None = None, *, chat: bool = False,
        enable_thinking: bool | None = None,
    ) -> GenerationResult:
        ids: list[int] = []
        text = ""
        delta = None
        for delta in self.stream(prompt, params, chat=chat, enable_thinking=enable_thinking):
            ids += delta.token_ids
            text += delta.text
        assert delta is not None
        return GenerationResult(token_ids=ids, text=text, finish_reason=delta.finish_reason or "length", stats=delta.stats)

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, *, chat: bool = False,
        enable_thinking: bool | None = None,
    ) -> Iterator[StreamDelta]:
        """Generate incrementally. Closing the iterator early (client gone) stops decoding at once.

        At tp > 1 only rank 0 calls this: it sends each request to the other ranks, which decode it in lockstep
        (`follow`), and a stream closed early still decodes to its natural end, silently, so that every rank
        runs the same steps and their collectives stay matched."""
        params = params or SamplingParams()
        params.validate()
        prompt_ids = self.encode_prompt(prompt, chat, enable_thinking)
        if not prompt_ids:
            raise ValueError("prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens but the context is {self.max_model_len} tokens "
                "(max_model_len); shorten the prompt"
            )
        lockstep = group_size() > 1
        if lockstep:
            if not params.greedy and params.seed is None:  # every rank must draw the same tokens
                params = replace(params, seed=random.randrange(2**63))
            broadcast_object((prompt_ids, params))
        deltas = self._decode(prompt_ids, params)
        try:
            for delta in deltas:
                yield delta
        finally:
            if lockstep:
                for _ in deltas:
                    pass
            deltas.close()

    def follow(self) -> None:
        """Every rank but 0 at tp > 1: decode each request rank 0 streams, in lockstep with it, until rank 0
        calls `release_followers`."""
        while (request := broadcast_object(None)) is not None:
            for _ in self._decode(*request):
                pass

    def release_followers(self) -> None:
        """Rank 0: end the other ranks' `follow` (nothing at tp 1)."""
        if group_size() > 1:
            broadcast_object(None)

    def _decode(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[StreamDelta]:
        """The decode loop of one admitted request: prefill, then steps until a stop or the token budget."""
        budget = min(params.max_new_tokens, self.max_model_len - len(prompt_ids))
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        stats = GenerationStats(prompt_tokens=len(prompt_ids))
        generator = make_generator(params, self.device)
        detok = IncrementalDetokenizer(self.tokenizer, params.stop)

        t0 = time.perf_counter()
        pending = [self.decoder.prefill(prompt_ids, params, generator)]
        stats.prefill_seconds = time.perf_counter() - t0
        stats.verify_steps = 1  # the prefill forward produced the first token
        t0 = time.perf_counter()
        while True:
            for tok in pending:
                stats.completion_tokens += 1
                text, stopped_by_string = detok.push(tok)
                finish = None
                if tok in stop_ids or stopped_by_string:
                    finish = "stop"
                elif stats.completion_tokens >= budget:
                    finish = "length"
                if finish:
                    stats.decode_seconds = time.perf_counter() - t0
                    for phase, seconds in self.decoder.phase_seconds().items():
                        setattr(stats, f"{phase}_seconds", seconds)
                    yield StreamDelta([tok], text + detok.flush(), finish, stats)
                    return
                yield StreamDelta([tok], text, None, stats)
            pending = self.decoder.step(params, generator)
            stats.verify_steps += 1
            size = self.decoder.last_step_drafts
            stats.draft_tokens += size
            stats.draft_sizes[size] = stats.draft_sizes.get(size, 0) + 1
            stats.accepted_draft_tokens += len(pending) - 1
