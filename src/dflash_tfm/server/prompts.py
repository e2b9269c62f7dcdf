"""Request prompts to token ids, without blocking the event loop and refusing over-long ones before tokenizing.

Tokenizing a multi-megabyte prompt takes seconds; on the event loop it would stall every other request and
`/health`. Here a text that cannot fit the context is refused from its length alone (no token stands for
more than `Engine.max_chars_per_token` characters), id lists from their count, and the rest is tokenized on
one dedicated thread, so the loop keeps answering and tokenizations do not pile up on the CPU.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable

from dflash_tfm.server.errors import APIError

if TYPE_CHECKING:
    from dflash_tfm.engine.engine import Engine


class PromptEncoder:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.max_chars = engine.max_model_len * engine.max_chars_per_token
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflash-tfm-tokenizer")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def check_chars(self, chars: int, field: str) -> None:
        if chars > self.max_chars:
            raise APIError(400, f"prompt has {chars} characters, more than fit the context of "
                                f"{self.engine.max_model_len} tokens (max_model_len; no token covers more than "
                                f"{self.engine.max_chars_per_token} characters); shorten the prompt", field)

    async def _off_loop(self, fn: Callable[[], list[int]]) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    async def text(self, text: str, field: str) -> list[int]:
        """Raw text (no special tokens added)."""
        self.check_chars(len(text), field)
        return await self._off_loop(lambda: self.engine.encode_prompt(text))

    async def chat(self, messages: list[dict], enable_thinking: bool | None) -> list[int]:
        """Chat messages through the model's chat template, with the generation prompt."""
        self.check_chars(sum(len(m["content"]) for m in messages), "messages")
        try:
            return await self._off_loop(lambda: self.engine.apply_chat_template(messages, enable_thinking))
        except Exception as e:  # jinja templates raise anything on unexpected roles/orders
            raise APIError(400, f"messages: the chat template rejected them: {e}", "messages") from e

    def ids(self, ids: list[int], field: str) -> list[int]:
        """Token ids, counted against the context before each is checked against the vocabulary (an
        out-of-range id would index past the embedding)."""
        if len(ids) >= self.engine.max_model_len:
            raise APIError(400, f"prompt has {len(ids)} tokens but the context is {self.engine.max_model_len} tokens "
                                "(max_model_len), leaving no room for a completion; shorten the prompt", field)
        try:
            return self.engine.encode_prompt(ids)
        except ValueError as e:
            raise APIError(400, f"{field}: {e}", field) from e
