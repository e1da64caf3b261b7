"""OpenAI-compatible response bodies and stream chunks (completions and chat
completions), and the ids and timestamps they carry."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, model_serializer

from elasticep.frontend.logprobs_format import ChatLogprobs, CompletionLogprobs
from elasticep.frontend.openai_tools import ToolCallOut


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class _Choice(BaseModel):
    """Fields every choice shares."""

    index: int = 0
    finish_reason: str | None


class _Response(BaseModel):
    """Fields every response and stream chunk shares."""

    id: str
    created: int
    model: str


class CompletionChoice(_Choice):
    text: str
    logprobs: CompletionLogprobs | None = None


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
    tool_calls: list[ToolCallOut] | None = None

    @model_serializer(mode="wrap")
    def _no_null_calls(self, handler: Any) -> dict[str, Any]:
        # a reply without tools keeps the shape it had before tool calls existed
        out = handler(self)
        if out.get("tool_calls") is None:
            out.pop("tool_calls", None)
        return out


class ChatChoice(_Choice):
    message: ChatDelta
    logprobs: ChatLogprobs | None = None


class ChatStreamChoice(_Choice):
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None


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
