"""Request and response shapes: OpenAI chat/completions and the native (SGLang-style) `/generate`.

Requests are parsed from the raw JSON in strict mode, so `"16"` is not silently taken for 16 and `true` not
for 1.0. Nothing a client asks for is silently dropped: OpenAI requests keep unknown top-level fields only to
name them in the 400 ("not supported by this server: tools"); OpenAI features this engine cannot honour are
accepted only at their neutral value (`presence_penalty: 0`, `response_format: {"type": "text"}`, ...).
`user` is accepted, since it only identifies the caller. Native `sampling_params` and chat messages reject
unknown keys outright, since a misspelled key would otherwise change the output silently.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, ValidationError, model_serializer

from dflash_tfm.sampling_params import SamplingParams

FinishReason = Literal["stop", "length"]
SEED_RANGE = {"ge": -(2**63), "le": 2**64 - 1}  # what torch.Generator.manual_seed accepts


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class _Lenient(BaseModel):
    """Unknown fields are kept in `model_extra` so the server can name them when it refuses them."""

    model_config = ConfigDict(strict=True, extra="allow")


# ---- errors ---------------------------------------------------------------------------------------------

class ErrorBody(BaseModel):
    message: str
    type: str
    code: int | str
    param: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def describe_validation_error(e: ValidationError) -> tuple[str, str | None]:
    """(message, param) for a pydantic error, collapsing the one-error-per-alternative noise of union fields."""
    by_field: dict[str, list[dict]] = {}
    for err in e.errors(include_url=False):
        if err["type"] == "json_invalid":
            return f"malformed JSON body: {err['ctx']['error']}", None
        if err["type"] == "model_type" and not err["loc"]:
            return "request body must be a JSON object", None
        # union alternatives appear in loc as type names ('str', 'list[int]', 'ChatMessage'); drop them
        loc = [str(x) for x in err["loc"] if isinstance(x, int) or not (x[:1].isupper() or "[" in x or x in _TYPE_TAGS)]
        by_field.setdefault(".".join(loc), []).append(err)
    parts = []
    for loc, errs in list(by_field.items())[:3]:
        if errs[0]["type"] == "missing":
            parts.append(f"{loc}: field required")
        elif errs[0]["type"] == "extra_forbidden":
            parts.append(f"{loc}: unknown field")
        elif len(errs) > 1:
            parts.append(f"{loc}: {_short(errs[0]['input'])} has the wrong type for this field")
        else:
            parts.append(f"{loc}: {errs[0]['msg']} (got {_short(errs[0]['input'])})")
    return "; ".join(parts), next(iter(by_field), None)


def _short(value: object) -> str:
    text = json.dumps(value, default=repr)
    return text if len(text) <= 60 else text[:57] + "..."


# ---- OpenAI requests -------------------------------------------------------------------------------------

class ContentPart(_Strict):
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None  # OpenAI's participant name; chat templates that know it read it


class StreamOptions(_Strict):
    include_usage: bool = False


class OpenAIRequest(_Lenient):
    """Fields shared by chat and completions. None means "not given" and takes the OpenAI default."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = Field(default=None, **SEED_RANGE)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Known OpenAI features the engine cannot honour: accepted only at their neutral value.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> list[str]:
        """Names of requested features this server would otherwise silently drop: the known ones away from
        their neutral value, then every unknown field."""
        bad = [name for name in ("presence_penalty", "frequency_penalty") if getattr(self, name) not in (None, 0, 0.0)]
        if self.logit_bias:
            bad.append("logit_bias")
        if self.logprobs not in (None, False, 0):
            bad.append("logprobs")
        if self.tools:
            bad.append("tools")
        if self.tool_choice not in (None, "none", "auto"):
            bad.append("tool_choice")
        if self.response_format not in (None, {"type": "text"}):
            bad.append("response_format")
        return bad + sorted(self.model_extra or {})

    def sampling_params(self, max_new_tokens: int) -> SamplingParams:
        """Validated SamplingParams (ValueError names the bad field). OpenAI's default temperature is 1."""
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            max_new_tokens=max_new_tokens,
            seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # newer OpenAI name for max_tokens; wins when both are given
    chat_template_kwargs: dict[str, Any] | None = None  # SGLang/vLLM: {"enable_thinking": bool}
    top_logprobs: int | None = None

    def unsupported(self) -> list[str]:
        return super().unsupported() + (["top_logprobs"] if self.top_logprobs else [])

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(OpenAIRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        bad += ["echo"] if self.echo else []
        bad += ["best_of"] if self.best_of not in (None, 1) else []
        return bad + (["suffix"] if self.suffix else [])


# ---- OpenAI responses ------------------------------------------------------------------------------------

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    """OpenAI sends only the fields a delta carries ({"role": ...} first, then {"content": ...}, then {})."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _only_given(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: FinishReason | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: FinishReason | None = None
    logprobs: None = None


class CompletionResponse(BaseModel):
    """Also the streamed chunk shape (OpenAI uses object "text_completion" for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "dflash-tfm"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---- native /generate ------------------------------------------------------------------------------------

class NativeSamplingParams(_Strict):
    """SGLang's names and defaults (temperature 1; max_new_tokens 128, applied by the server so that only an
    explicit value is checked against the context). top_k -1 or 0 = off."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    sampling_seed: int | None = Field(default=None, **SEED_RANGE)
    adaptive_ar: bool = False  # sent by the benchmark harness (--adaptive-ar); no effect in this engine

    def to_sampling_params(self, max_new_tokens: int) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, max_new_tokens=max_new_tokens,
            seed=self.sampling_seed, stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
        )


class GenerateRequest(_Strict):
    """Exactly one of `text` (raw text, tokenized without special tokens) or `input_ids`."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    stream: bool = False
    rid: str | None = None
    return_logprob: Literal[False] = False


class NativeFinishReason(BaseModel):
    """SGLang's shape: {"type": "stop"} or {"type": "length", "length": completion_tokens}."""

    type: FinishReason
    length: int | None = None


class MetaInfo(BaseModel):
    id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # no prefix cache: never any
    spec_verify_ct: int  # target forward passes that produced tokens (= completion_tokens for AR)
    finish_reason: NativeFinishReason | None = None
    e2e_latency: float


class GenerateResponse(BaseModel):
    text: str
    output_ids: list[int]
    meta_info: MetaInfo
