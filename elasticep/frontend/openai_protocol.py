"""OpenAI-compatible request/response models (completions and chat completions).

Requests are strict: an unknown field is a 400, and so is a known OpenAI field whose
non-default value we do not implement (``n > 1``, ``logprobs``, penalties, ...), so a
client never silently gets something other than what it asked for. Errors use the
OpenAI shape ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from elasticep.engine.request import SamplingParamError, SamplingParams
from elasticep.models.config import SamplingDefaults


class OpenAIError(Exception):
    """An error answered to the client as OpenAI error JSON with an HTTP status.

    Args:
        status: HTTP status code (4xx for client mistakes).
        message: human readable explanation.
        type: OpenAI error type, e.g. "invalid_request_error".
        param: the offending request field, if any.
        code: short machine readable code, if any.
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The JSON body to send."""
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI error JSON: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    """Fields shared by both endpoints; unsupported ones accept only their default."""

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="extension; 0 or -1 disables it")
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False

    # field -> the only value we implement; anything else is a 400 naming the field
    UNSUPPORTED: ClassVar[dict[str, Any]] = {
        "n": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": None}
    # fields whose JSON null means "not sent", as in OpenAI's API and vLLM (clients that
    # serialise every field send them): the default, or the model's, then applies
    NULL_IS_UNSET: ClassVar[tuple[str, ...]] = (
        "temperature", "top_p", "top_k", "n", "stream", "presence_penalty",
        "frequency_penalty", "ignore_eos", "max_tokens", "max_completion_tokens", "echo")

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items()
                    if not (v is None and k in cls.NULL_IS_UNSET and k in cls.model_fields)}
        return data

    def check_supported(self) -> None:
        """Reject known OpenAI options we do not implement.

        Raises:
            OpenAIError: 400 naming the first unsupported field.
        """
        for name, default in self.UNSUPPORTED.items():
            value = getattr(self, name)
            if value != default and value not in ({}, ()):
                raise OpenAIError(400, f"{name}={value!r} is not supported (only "
                                  f"{default!r})", param=name)

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def to_sampling_params(self, max_tokens: int,
                           defaults: SamplingDefaults = SamplingDefaults()) -> SamplingParams:
        """Engine sampling params with the resolved ``max_tokens``.

        Args:
            max_tokens: completion tokens.
            defaults: the model's ``generation_config.json`` values, used for the
                sampling fields the request does not send (then OpenAI's defaults).

        Raises:
            OpenAIError: 400 when a value is out of the engine's range.
        """
        def pick(name: str) -> Any:
            model_value = getattr(defaults, name)
            if name in self.model_fields_set or model_value is None:
                return getattr(self, name)
            return model_value

        params = SamplingParams(max_tokens=max_tokens, temperature=pick("temperature"),
                                top_p=pick("top_p"), top_k=max(pick("top_k"), 0), seed=self.seed,
                                stop=self.stop_strings(), ignore_eos=self.ignore_eos)
        try:
            params.validate()
        except SamplingParamError as exc:
            raise OpenAIError(400, str(exc), param=exc.param) from exc
        return params


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. ``prompt`` is text or token ids (one prompt only)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    UNSUPPORTED: ClassVar[dict[str, Any]] = {
        **_SamplingFields.UNSUPPORTED, "echo": False, "logprobs": None, "best_of": None,
        "suffix": None}

    @field_validator("best_of")
    @classmethod
    def _best_of_one_is_the_default(cls, value: int | None) -> int | None:
        # best_of 1 (one candidate per choice) is what every request gets; SGLang's
        # bench_serving sends it on every completion
        return None if value == 1 else value

    def single_prompt(self) -> str | list[int]:
        """The one prompt, unwrapped from a one-element batch.

        Raises:
            OpenAIError: 400 for an empty prompt or a batch of several prompts.
        """
        prompt: Any = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise OpenAIError(400, "only one prompt per request is supported",
                                  param="prompt")
            prompt = prompt[0]
        if len(prompt) == 0:
            raise OpenAIError(400, "prompt must not be empty", param="prompt")
        return prompt


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None

    UNSUPPORTED: ClassVar[dict[str, Any]] = {
        **_SamplingFields.UNSUPPORTED, "logprobs": False, "top_logprobs": None}

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def max_tokens_param(self) -> str:
        """The field :meth:`requested_max_tokens` came from, for error messages."""
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"


class ScaleRequest(_Strict):
    """POST /scale_elastic_ep: one of ``new_ep_size`` (grow or shrink from the top),
    ``retire_ranks`` (those slots leave) or ``drain_node`` (every slot of that node
    leaves), and an optional ``operation_id`` (a repeat with the same id changes
    nothing). Strict: ``"3"`` or ``true`` is not a size."""

    model_config = ConfigDict(extra="forbid", strict=True)

    new_ep_size: int | None = None
    retire_ranks: list[int] | None = Field(None, min_length=1)
    drain_node: int | None = Field(None, ge=0)
    operation_id: str | None = Field(None, min_length=1, max_length=128)

    def which(self) -> str:
        """The one change field given.

        Raises:
            OpenAIError: none or several (400).
        """
        given = [n for n in ("new_ep_size", "retire_ranks", "drain_node")
                 if getattr(self, n) is not None]
        if len(given) != 1:
            raise OpenAIError(400, "give exactly one of new_ep_size, retire_ranks and "
                              f"drain_node (got {given or 'none'})")
        return given[0]


def resolve_max_tokens(prompt_len: int, requested: int | None, max_model_len: int,
                       param: str = "max_tokens") -> int:
    """How many tokens to generate; None means "the rest of the context".

    Args:
        prompt_len: the prompt's tokens.
        requested: the completion tokens the client asked for; None: the rest.
        max_model_len: the model's context length, in tokens.
        param: the request field ``requested`` came in, named in the error (e.g.
            ``max_completion_tokens``, or ``/generate``'s ``sampling_params.max_new_tokens``).

    Raises:
        OpenAIError: 400 when prompt + ``requested`` does not fit ``max_model_len`` tokens.
    """
    if prompt_len >= max_model_len:
        raise OpenAIError(400, f"This model's maximum context length is {max_model_len} "
                          f"tokens, but the prompt has {prompt_len} tokens.",
                          param="prompt", code="context_length_exceeded")
    if requested is None:
        return max_model_len - prompt_len
    if prompt_len + requested > max_model_len:
        raise OpenAIError(400, f"This model's maximum context length is {max_model_len} "
                          f"tokens. However, you requested {prompt_len + requested} tokens "
                          f"({prompt_len} in the prompt, {requested} for the completion).",
                          param=param, code="context_length_exceeded")
    return requested


# ---- responses ------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class _Choice(BaseModel):
    """Fields every choice shares (one choice per request: ``n`` is 1)."""

    index: int = 0
    logprobs: None = None
    finish_reason: str | None


class _Response(BaseModel):
    """Fields every response and stream chunk shares."""

    id: str
    created: int
    model: str


class CompletionChoice(_Choice):
    text: str


class CompletionResponse(_Response):
    """A whole completion, or (with ``usage`` None) one SSE chunk of one."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


def completion_chunk_renderer(rid: str, created: int, model: str,
                              ) -> Callable[[str, str | None], str]:
    """``render(text, finish_reason)``: the JSON of one streamed :class:`CompletionResponse`
    chunk, byte for byte what ``model_dump_json`` gives, without building the models
    per token (that was a tenth of a streamed token's cost on the event loop).

    The fixed parts come from one chunk pydantic renders with placeholder values;
    each token then only JSON-encodes its text and finish reason.
    """
    mark = uuid.uuid4().hex
    text_mark, finish_mark = f"text-{mark}", f"finish-{mark}"
    ref = CompletionResponse(id=rid, created=created, model=model, choices=[
        CompletionChoice(text=text_mark, finish_reason=finish_mark)]).model_dump_json()
    head, rest = ref.split(json.dumps(finish_mark))
    middle, tail = rest.split(json.dumps(text_mark))

    def render(text: str, finish_reason: str | None) -> str:
        return (f"{head}{json.dumps(finish_reason)}{middle}"
                f"{json.dumps(text, ensure_ascii=False)}{tail}")

    return render


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChoice(_Choice):
    message: ChatDelta


class ChatStreamChoice(_Choice):
    delta: ChatDelta


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


def new_id(prefix: str) -> str:
    """A fresh OpenAI-style id such as ``cmpl-3f2a...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """Unix seconds, for the ``created`` fields."""
    return int(time.time())
