"""Owns the target model, its static caches and the CUDA graphs of the decode step.

Prefill runs eagerly in chunks (bounded activation memory for long prompts). Decode of one token is
captured once per key-length bucket (powers of two up to the max length): attention reads only
`bucket` cache slots, so short contexts do not pay for the whole static cache, and a replay launches the
entire step with no host work but copying the token and position into static buffers.
"""
from __future__ import annotations

from typing import Callable

import torch

from dflash_tfm.models.cache import ModelCache
from dflash_tfm.layers.compile import unfused
from dflash_tfm.layers.linear import skinny_projections
from dflash_tfm.models.decoder import CausalLM

MIN_BUCKET = 256
# Prompt chunks of an attention-only target on CUDA are padded to a multiple of this many tokens: each new
# prefill shape cost a one-time 0.1-0.8 s (an ad-hoc H100 probe with SmolLM2 shapes, docs/PERFORMANCE.md "Prompt
# prefill"; `benchmarks/bench_prefill.py` now times it), and a server sees a new prompt length with nearly every
# request; padded, a few dozen shapes serve every prompt.
PREFILL_PAD = 64


def prefill_padding(model: CausalLM, token_ids: torch.Tensor) -> int:
    """The multiple a prompt chunk is padded to: `PREFILL_PAD` for an attention-only target on CUDA, else 1.
    Padding tokens sit after the prompt, so no prompt token attends to them, and the K/V they write at later
    positions are overwritten before any query reads them; a Gated-DeltaNet layer would fold them into its
    recurrent state, so hybrid targets prefill exact lengths."""
    return PREFILL_PAD if token_ids.is_cuda and not model.config.is_hybrid else 1


def key_length_bucket(position: int, max_len: int) -> int:
    """Smallest power-of-two key length (>= MIN_BUCKET, <= max_len) covering `position`: decode steps read this
    many cache slots, so a few shapes serve every position (one CUDA graph, one kernel choice per bucket)."""
    b = MIN_BUCKET
    while b <= position:
        b *= 2
    return min(b, max_len)


def prefill_in_chunks(
    model: CausalLM, token_ids: torch.Tensor, cache: ModelCache, start: int, chunk: int,
    tap_layers: tuple[int, ...] = (), on_taps: Callable[[list[torch.Tensor], int], None] | None = None,
    pad_to: int | None = None,
) -> torch.Tensor:
    """Feed token_ids [T] (on the model's device) into batch-1 `cache` at positions start.. in chunks of `chunk`
    (bounded activation memory); returns the final-normed hidden state [hidden] of the last token. Each chunk
    runs padded to a multiple of `pad_to` tokens (default `prefill_padding`; never past the cache's end), the
    padding's outputs dropped."""
    T = token_ids.shape[0]
    if T == 0:
        raise ValueError("an empty prompt has nothing to prefill")
    pad_to = prefill_padding(model, token_ids) if pad_to is None else pad_to
    hidden = None
    with unfused():  # a new length every request: compiled helpers would recompile and pay their guards
        for s in range(0, T, chunk):
            e = min(T, s + chunk)
            n = e - s
            width = min(-(-n // pad_to) * pad_to, cache.max_len - start - s)
            ids = token_ids[s:e]
            if width > n:  # repeats of the chunk's last token: any real id would do
                ids = torch.cat((ids, ids[-1:].expand(width - n)))
            positions = torch.arange(start + s, start + s + width, device=ids.device).view(1, -1)
            hidden, taps = model(ids.view(1, -1), positions, cache, kv_len=start + s + width, tap_layers=tap_layers)
            if on_taps is not None:
                on_taps([t[:, :n] for t in taps], start + s)
    return hidden[0, n - 1]


class ModelRunner:
    def __init__(
        self, model: CausalLM, max_len: int, device: torch.device, use_cuda_graph: bool = True,
        prefill_chunk: int = 2048, cache: ModelCache | None = None,
    ) -> None:
        """`cache`: a batch-1 cache to decode in (a row of a continuous batch's cache), else one of its own."""
        self.model = model
        self.max_len = max_len
        self.device = device
        self.dtype = model.embed_tokens.dtype
        self.cache = cache if cache is not None else ModelCache(model.config, max_len, batch=1, dtype=self.dtype,
                                                                device=device)
        self.use_cuda_graph = use_cuda_graph and device.type == "cuda"
        self.prefill_chunk = prefill_chunk
        self._graphs: dict[tuple[int, tuple[int, ...]], tuple[torch.cuda.CUDAGraph, tuple]] = {}
        self._graph_pool = None
        self._static_ids = torch.zeros(1, 1, dtype=torch.long, device=device)
        self._static_pos = torch.zeros(1, 1, dtype=torch.long, device=device)

    def reset(self) -> None:
        self.cache.reset()

    @torch.inference_mode()
    def prefill(
        self, token_ids: torch.Tensor, start: int = 0, tap_layers: tuple[int, ...] = (),
        on_taps: Callable[[list[torch.Tensor], int], None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed token_ids [T] at positions start.. in chunks.

        Returns fp32 logits [V] and the final-normed hidden state [hidden] of the last token. With
        `tap_layers`, `on_taps(taps, chunk_start)` receives each chunk's tap-layer outputs ([1, t, hidden]
        each) as soon as it is computed, so the drafter's context never needs the whole prompt's taps.
        """
        T = token_ids.shape[0]
        if start + T > self.max_len:
            raise ValueError(f"{start + T} tokens exceed the engine's max length {self.max_len}")
        last = prefill_in_chunks(self.model, token_ids.to(self.device), self.cache, start, self.prefill_chunk,
                                 tap_layers, on_taps)
        return self.model.logits(last), last

    def bucket(self, position: int) -> int:
        return key_length_bucket(position, self.max_len)

    @torch.inference_mode()
    def decode(self, token: torch.Tensor, position: int) -> torch.Tensor:
        """One token (a device tensor of 1 element) at `position` -> fp32 logits [1, V]; advances the caches."""
        return self.decode_with_taps(token, position)[0]

    @torch.inference_mode()
    def decode_with_taps(self, token: torch.Tensor, position: int,
                         tap_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """`decode` that also returns the final-normed hidden state [hidden] and the outputs of `tap_layers`
        ([1, 1, hidden] each): a speculative decoder's plain decode step, which must still feed its drafter."""
        if position >= self.max_len:
            raise ValueError(f"position {position} is beyond the engine's max length {self.max_len}")
        kv_len = self.bucket(position)
        self._static_ids.copy_(token.view(1, 1))
        self._static_pos.fill_(position)
        if not self.use_cuda_graph:
            return self._step(kv_len, tap_layers)
        key = (kv_len, tap_layers)
        if key not in self._graphs:
            self._capture(kv_len, tap_layers)
        graph, outputs = self._graphs[key]
        graph.replay()
        return outputs

    def _step(self, kv_len: int, tap_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor, list]:
        with skinny_projections():  # one row: the projections may take their tuned kernel (layers/linear.py)
            hidden, taps = self.model(self._static_ids, self._static_pos, self.cache, kv_len=kv_len,
                                      tap_layers=tap_layers)
            return self.model.logits(hidden[:, -1]), hidden[0, -1], taps

    def _capture(self, kv_len: int, tap_layers: tuple[int, ...]) -> None:
        """Warm up (compiles Triton kernels, picks cuBLAS algorithms) and capture one decode step.

        The warm-up step runs on a scratch copy of the recurrent caches' contents so capture leaves the
        live state exactly as it was: the real step is the replay that follows."""
        saved = self.cache.states.clone(), self.cache.windows.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step(kv_len, tap_layers)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            outputs = self._step(kv_len, tap_layers)
        self.cache.states.copy_(saved[0])
        self.cache.windows.copy_(saved[1])
        self._graphs[(kv_len, tap_layers)] = (graph, outputs)
