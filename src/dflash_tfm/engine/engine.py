"""`Engine`: the facade users, the CLI and the server call.

`stream` / `generate` decode one request (batch 1, every algorithm). An autoregressive engine built with
`max_running_requests` > 1 also serves many requests at once by continuous batching: `add_request`, then `step`
until each request's last delta, `abort_request` to drop one (engine/continuous_batching.py).

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
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import torch

from dflash_tfm import tuning
from dflash_tfm.engine.batch_runner import BatchRunner
from dflash_tfm.engine.continuous_batching import ContinuousBatch
from dflash_tfm.engine.decoder_factory import build_decoder
from dflash_tfm.engine.detokenizer import IncrementalDetokenizer
from dflash_tfm.engine.model_runner import ModelRunner
from dflash_tfm.engine.result import GenerationResult, GenerationStats
from dflash_tfm.engine.sequence import Sequence, StreamDelta
from dflash_tfm.engine.speculative_batch import TREE_SLACK, SpeculativeBatch
from dflash_tfm.loading.default_model import DEFAULT_BUNDLE
from dflash_tfm.loading.loader import auto_dtype, load_target, parse_dtype
from dflash_tfm.parallel.group import broadcast_object, init_tensor_parallel, tp_rank, tp_size as group_size
from dflash_tfm.parallel.sharding import Shard, check_ep_size
from dflash_tfm.sampling import make_generator
from dflash_tfm.sampling_params import SamplingParams
from dflash_tfm.speculative_config import SpeculativeConfig

DEFAULT_MAX_MODEL_LEN = 32768

Prompt = str | list[int] | list[dict]


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
        ep_size: int = 1,
        max_running_requests: int = 1,
    ) -> None:
        """model_path None = the embedded SmolLM2-135M-Instruct; then a speculative config without checkpoint
        paths uses the bundle trained for it (loading.default_model.DEFAULT_BUNDLE).
        dtype "auto" = bfloat16 on CUDA and on CPUs that multiply bf16 natively, else float32
        (`loading.loader.auto_dtype`).
        quantization "fp8" holds a BF16 checkpoint's projections in FP8 (loading/fp8_layout.py); FP8 checkpoints
        load as FP8 either way.
        max_model_len defaults to min(the model's context, 32768) and sizes the static caches.
        max_running_requests > 1 sizes the caches for that many rows and enables continuous batching
        (`add_request` / `step`): autoregressive (`ContinuousBatch`) or speculative (`SpeculativeBatch`, with
        `auto` one adaptive budget per batch bucket); `stream` then decodes in row 0, so it refuses to run while
        batched requests hold slots.
        `self.speculative` is the config as run: checkpoint paths filled in, block_size the drafter's own.
        tp_size > 1 splits the target over that many processes (`parallel/`), each of which builds this Engine
        (started by the command itself or a launcher): the drafter and Weaver are replicated, so every rank builds
        the same tree and accepts the same tokens, and only the target's projections communicate. With continuous
        batching rank 0 sends each step's admissions and aborts to the others before the step (`follow`).
        ep_size = tp_size (expert parallelism) has each rank hold 1 / tp_size of a mixture-of-experts target's
        routed experts whole, instead of a slice of every expert (`parallel/sharding.py`); 1 keeps the slices."""
        speculative = (speculative or SpeculativeConfig()).with_checkpoints(DEFAULT_BUNDLE if model_path is None else None)
        if max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {max_running_requests}")
        check_ep_size(tp_size, ep_size)
        self.device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' requested but CUDA is not available")
        self.device = init_tensor_parallel(tp_size, self.device.type) if tp_size > 1 else self.device
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # events, streams and graph captures act on the current device
        if dtype == "auto":
            dtype = auto_dtype(self.device)
        self.dtype = parse_dtype(dtype)
        # RoPE tables only need the positions the caches can hold (not e.g. Qwen3.6's 262144).
        spec_batch = max_running_requests > 1 and speculative.enabled
        slack = TREE_SLACK if spec_batch else 0  # a batched tree may reach past the context (`SpeculativeBatch`)
        loaded = load_target(model_path, self.device, self.dtype,
                             max_positions=(max_model_len or DEFAULT_MAX_MODEL_LEN) + slack, progress=progress,
                             quantization=quantization, shard=Shard(tp_rank(), tp_size, experts=ep_size > 1))
        self.config, self.tokenizer, self.model_path = loaded.config, loaded.tokenizer, loaded.source_path
        limit = min(self.config.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        self.max_model_len = int(max_model_len or limit)
        if not 1 < self.max_model_len <= self.config.max_position_embeddings:
            raise ValueError(
                f"max_model_len must be in [2, {self.config.max_position_embeddings}], got {self.max_model_len}"
            )
        self.max_running_requests = max_running_requests
        self.batch: ContinuousBatch | SpeculativeBatch | None = None
        self._streaming = False  # a `stream` is open (it decodes in row 0 of the batch's cache)
        # Rank 0 at tp > 1: the admissions and aborts the other ranks apply before the next batched step. A
        # request is known there by its slot: every rank fills and frees slots in the same order.
        self._lockstep_commands: list[tuple] = []
        shared_cache = None
        if max_running_requests > 1:
            batch_runner = BatchRunner(loaded.model, max_running_requests, self.max_model_len + slack, self.device,
                                       use_cuda_graph=use_cuda_graph)
            shared_cache = batch_runner.cache.row(0)  # one request alone decodes in row 0: no second cache
        self.runner = ModelRunner(loaded.model, self.max_model_len, self.device, use_cuda_graph=use_cuda_graph,
                                  cache=shared_cache)
        self.decoder = build_decoder(self.runner, self.config, speculative, drafter_rows=max_running_requests)
        if spec_batch:  # the batch shares the decoder's drafter (row 0 is the lone request's) and its proposers
            proposers = self.decoder.proposers
            if not speculative.adaptive:
                (proposers,) = proposers.values()
            self.batch = SpeculativeBatch(batch_runner, self.decoder.drafter, proposers, self.max_model_len)
            if speculative.adaptive:  # each batch bucket's step time at every size, on this machine
                self.batch.measure_step_times(steps=1 if self.device.type == "cpu" else 3)
        elif max_running_requests > 1:
            self.batch = ContinuousBatch(batch_runner)
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

    def _new_sequence(
        self, prompt: Prompt, params: SamplingParams | None = None, *, chat: bool = False,
        enable_thinking: bool | None = None,
    ) -> Sequence:
        """A validated request (ValueError names what is wrong): encoded prompt, budget, stop ids, generator. At
        tp > 1 a sampled request without a seed gets one here, so that every rank draws the same tokens."""
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
        if group_size() > 1 and not params.greedy and params.seed is None:
            params = replace(params, seed=random.randrange(2**63))
        return self._sequence(prompt_ids, params)

    def _sequence(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        return Sequence(
            prompt_ids=prompt_ids, params=params,
            stop_ids=set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids),
            budget=min(params.max_new_tokens, self.max_model_len - len(prompt_ids)),
            generator=make_generator(params, self.device),
            detokenizer=IncrementalDetokenizer(self.tokenizer, params.stop),
            stats=GenerationStats(prompt_tokens=len(prompt_ids)),
        )

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, *, chat: bool = False,
        enable_thinking: bool | None = None,
    ) -> Iterator[StreamDelta]:
        """Generate incrementally. Closing the iterator early (client gone) stops decoding at once.

        At tp > 1 only rank 0 calls this: it sends each request to the other ranks, which decode it in lockstep
        (`follow`), and a stream closed early still decodes to its natural end, silently, so that every rank
        runs the same steps and their collectives stay matched."""
        seq = self._new_sequence(prompt, params, chat=chat, enable_thinking=enable_thinking)
        if self.batch is not None and self.batch.running:
            raise RuntimeError(f"stream decodes in cache row 0, which {self.batch.running} batched requests may "
                               "hold: finish or abort them first (or use add_request)")
        lockstep = group_size() > 1
        if lockstep:
            broadcast_object(("stream", seq.prompt_ids, seq.params))
        self._streaming = True
        deltas = self._decode_alone(seq)
        try:
            for delta in deltas:  # not `yield from`: closing this stream would close `deltas` before the finally
                yield delta
        finally:
            if lockstep:
                for _ in deltas:
                    pass
            deltas.close()
            self._streaming = False

    def follow(self) -> None:
        """Every rank but 0 at tp > 1: in lockstep with rank 0, decode each request it streams and take each
        batched step it takes, with the same admissions and aborts first, until rank 0 calls
        `release_followers`."""
        while (message := broadcast_object(None)) is not None:
            if message[0] == "stream":
                for _ in self._decode_alone(self._sequence(*message[1:])):
                    pass
                continue
            batch = self._running_batch()
            for command, *args in message[1]:
                if command == "add":
                    batch.add(self._sequence(*args))
                else:  # ("abort", slot): the slot rank 0's request held, which this rank's copy holds too
                    batch.abort(batch.in_slot(args[0]))
            batch.step()

    def release_followers(self) -> None:
        """Rank 0: end the other ranks' `follow` (nothing at tp 1)."""
        if group_size() > 1:
            broadcast_object(None)

    def _decode_alone(self, seq: Sequence) -> Iterator[StreamDelta]:
        stats = seq.stats
        t0 = time.perf_counter()
        pending = [self.decoder.prefill(seq.prompt_ids, seq.params, seq.generator)]
        stats.prefill_seconds = time.perf_counter() - t0
        stats.verify_steps = 1  # the prefill forward produced the first token
        seq.decode_started = time.perf_counter()
        while True:
            for tok in pending:
                delta = seq.push(tok)
                if seq.finished:
                    for phase, seconds in self.decoder.phase_seconds().items():
                        setattr(stats, f"{phase}_seconds", seconds)
                    stats.expected_accepted_draft_tokens = self.decoder.expected_drafts()
                yield delta
                if seq.finished:
                    return
            pending = self.decoder.step(seq.params, seq.generator)
            stats.count_step(self.decoder.last_step_drafts, len(pending))

    # ---- continuous batching (max_running_requests > 1) ----------------------------------------------
    def _running_batch(self) -> ContinuousBatch | SpeculativeBatch:
        if self.batch is None:
            raise RuntimeError("continuous batching needs an Engine built with max_running_requests > 1; this one "
                               "decodes one request at a time (use stream)")
        return self.batch

    @property
    def free_slots(self) -> int:
        """Requests `add_request` can take now (0 for an engine without continuous batching)."""
        return 0 if self.batch is None else self.batch.free_slots

    def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, *, chat: bool = False,
        enable_thinking: bool | None = None,
    ) -> Sequence:
        """Admit a request into the running batch (ValueError for a bad request, RuntimeError without a free
        slot); it is prefilled by a coming `step` and decodes with the others from then on."""
        batch = self._running_batch()
        if self._streaming:
            raise RuntimeError("a stream is decoding in cache row 0: finish or close it before add_request")
        seq = self._new_sequence(prompt, params, chat=chat, enable_thinking=enable_thinking)
        batch.add(seq)
        if group_size() > 1:  # the other ranks admit it before the next step
            self._lockstep_commands.append(("add", seq.prompt_ids, seq.params))
        return seq

    def step(self) -> list[tuple[Sequence, StreamDelta]]:
        """One step of the running batch: each request's new token as (request, delta); a request's last delta
        carries its finish reason, and its slot is free again. At tp > 1 the admissions and aborts since the last
        step go to the other ranks first, so every rank steps the same batch."""
        batch = self._running_batch()
        if group_size() > 1:
            broadcast_object(("batch", self._lockstep_commands))
            self._lockstep_commands = []
        return batch.step()

    def abort_request(self, seq: Sequence) -> None:
        """Drop a running request (its client left) and free its slot."""
        batch = self._running_batch()
        if group_size() > 1 and batch.holds(seq):
            self._lockstep_commands.append(("abort", seq.slot))
        batch.abort(seq)
