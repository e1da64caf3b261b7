"""Completion and chat-completion handlers: tokenize, check, submit, stream or collect.

Streaming sends one SSE chunk per generated token (its text may be "" while a UTF-8
character or a possible stop string is incomplete), then an optional usage chunk, then
``data: [DONE]``. A non-streaming request that loses its client is aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from elasticep.engine.request import SamplingParams
from elasticep.frontend.core import Frontend, RequestStream
from elasticep.frontend.openai_protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatStreamChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    OpenAIError,
    Usage,
    completion_chunk_renderer,
    error_body,
    new_id,
    now,
    resolve_max_tokens,
)
from elasticep.frontend.request_tracker import (
    DuplicateRequestError,
    NoRankAvailableError,
    RequestEvent,
)
from elasticep.frontend.tokenizer import NoTokenizerError, TokenizerPool
from elasticep.frontend_link import monotonic_us
from elasticep.models.config import SamplingDefaults
from elasticep.utils.text import unicode_problem

logger = logging.getLogger(__name__)

TOKENIZER_THREADS = 4  # a giant prompt holds one of these; the others go on
# text prompts up to this many characters are encoded on the loop (under a
# millisecond), longer ones on the pool (TokenizerPool.run's inline)
INLINE_PROMPT_CHARS = 1024


@dataclass
class _Result:
    text: str
    num_tokens: int
    finish_reason: str | None
    error: str | None
    refused: bool = False


class DisconnectAwareStreamingResponse(StreamingResponse):
    """Streams while listening for the client's disconnect, whatever the ASGI version.

    Starlette only listens for ``http.disconnect`` on old ASGI spec versions; otherwise a
    gone client is noticed at the next write, which never comes while a request waits
    (for example parked during an outage). Cancelling the body iterator on disconnect
    lets the request's stream abort it on its rank.
    """

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async with anyio.create_task_group() as group:
            async def run_stream() -> None:
                with contextlib.suppress(OSError):
                    await self.stream_response(send)
                group.cancel_scope.cancel()

            group.start_soon(run_stream)
            await self.listen_for_disconnect(receive)
            group.cancel_scope.cancel()


class OpenAIServing:
    """Serves /v1/completions and /v1/chat/completions on a :class:`Frontend`.

    Args:
        frontend: routes and streams requests.
        tokenizer: a transformers tokenizer (``encode``, ``decode``,
            ``apply_chat_template``, ``chat_template``).
        model_name: the name clients must send as ``model``.
        max_model_len: prompt + completion tokens must fit this (context and KV cache).
        sampling_defaults: the model's ``generation_config.json`` sampling values, for
            the fields a request leaves unset.
    """

    def __init__(self, frontend: Frontend, tokenizer: Any, model_name: str,
                 max_model_len: int,
                 sampling_defaults: SamplingDefaults = SamplingDefaults()) -> None:
        self.frontend = frontend
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.sampling_defaults = sampling_defaults
        # Tokenizing a long prompt (or rendering a chat template) can take seconds: it
        # runs off the event loop, so that the other requests' streams, their checks and
        # /health go on meanwhile, and on a pool, so that it holds up one thread only.
        self.tokenizers = TokenizerPool(tokenizer, TOKENIZER_THREADS)

    # ---- request preparation -------------------------------------------------------
    def check_model(self, model: str) -> None:
        """Raises:
            OpenAIError: 404 ``model_not_found`` unless ``model`` is the served name.
        """
        if model != self.model_name:
            raise OpenAIError(404, f"The model `{model}` does not exist; this server serves "
                              f"`{self.model_name}`.", param="model", code="model_not_found")

    async def _completion_inputs(self, req: CompletionRequest,
                                 ) -> tuple[list[int], SamplingParams]:
        self.check_model(req.model)
        req.check_supported()
        ids = await self.encode_prompt(req.single_prompt(), "prompt")
        max_tokens = resolve_max_tokens(len(ids), req.max_tokens, self.max_model_len)
        return ids, req.to_sampling_params(max_tokens, self.sampling_defaults)

    async def encode_prompt(self, prompt: str | list[int], param: str) -> list[int]:
        """The token ids of a text prompt (tokenized off the event loop) or of an id list
        (checked against the vocabulary).

        Raises:
            OpenAIError: 400 naming ``param`` for invalid Unicode, a text prompt to a
                model without a tokenizer, an id out of range, or an empty prompt.
        """
        if isinstance(prompt, str):
            _check_unicode(prompt, param)
            try:
                ids = list(await self.tokenizers.run(
                    _encode, prompt, inline=len(prompt) <= INLINE_PROMPT_CHARS))
            except NoTokenizerError as exc:
                raise OpenAIError(400, str(exc), param=param) from None
        else:
            vocab = len(self.tokenizer)
            if any(not 0 <= t < vocab for t in prompt):
                raise OpenAIError(400, f"{param} token ids must be in [0, {vocab})",
                                  param=param)
            ids = list(prompt)
        if not ids:
            raise OpenAIError(400, f"{param} must not be empty", param=param)
        return ids

    async def _chat_inputs(self, req: ChatCompletionRequest,
                           ) -> tuple[list[int], SamplingParams]:
        self.check_model(req.model)
        req.check_supported()
        if not getattr(self.tokenizer, "chat_template", None):
            raise OpenAIError(400, f"The model `{self.model_name}` has no chat template, so "
                              "chat completions are unavailable; use /v1/completions.",
                              param="messages", code="chat_template_missing")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        for i, m in enumerate(messages):
            _check_unicode(m["content"], f"messages.{i}.content")
        ids = list(await self.tokenizers.run(_chat_ids, messages))
        max_tokens = resolve_max_tokens(len(ids), req.requested_max_tokens(),
                                        self.max_model_len, req.max_tokens_param())
        return ids, req.to_sampling_params(max_tokens, self.sampling_defaults)

    def submit(self, request_id: str, ids: list[int], params: SamplingParams,
               arrived_us: int | None = None) -> RequestStream:
        """Route a request; the stream of its events (close it: see ``Frontend.submit``).
        ``arrived_us``: when its handler began (``monotonic_us``), for the first-token
        trace; its prompt counts as tokenized now.

        Raises:
            OpenAIError: 503 with no healthy rank, 409 for a request id in flight.
        """
        try:
            return self.frontend.submit(request_id, ids, params, arrived_us, monotonic_us())
        except NoRankAvailableError as exc:
            raise OpenAIError(503, str(exc), type="service_unavailable") from exc
        except DuplicateRequestError as exc:
            raise OpenAIError(409, str(exc)) from exc

    # ---- endpoints -----------------------------------------------------------------
    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        """POST /v1/completions."""
        arrived = monotonic_us()
        ids, params = await self._completion_inputs(req)
        rid, created = new_id("cmpl"), now()
        stream = self.submit(rid, ids, params, arrived)

        def chunk(text: str, finish: str | None, usage: Usage | None = None) -> str:
            choices = [] if usage else [CompletionChoice(text=text, finish_reason=finish)]
            return CompletionResponse(id=rid, created=created, model=self.model_name,
                                      choices=choices, usage=usage).model_dump_json()

        if req.stream:
            render = completion_chunk_renderer(rid, created, self.model_name)
            return self.sse(stream, "completions", lambda e: render(e.text, e.finish_reason),
                            _usage_tail(chunk, len(ids), req.include_usage()))
        result = await self.collect(stream, raw, "completions")
        return JSONResponse(CompletionResponse(
            id=rid, created=created, model=self.model_name,
            choices=[CompletionChoice(text=result.text, finish_reason=result.finish_reason)],
            usage=_usage(len(ids), result.num_tokens)).model_dump())

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        """POST /v1/chat/completions."""
        arrived = monotonic_us()
        ids, params = await self._chat_inputs(req)
        rid, created = new_id("chatcmpl"), now()
        stream = self.submit(rid, ids, params, arrived)
        first = [True]

        def chunk(text: str, finish: str | None, usage: Usage | None = None) -> str:
            choices = []
            if usage is None:
                # the role rides on the first token's chunk: still one chunk per token
                delta = ChatDelta(role="assistant" if first[0] else None, content=text)
                first[0] = False
                choices = [ChatStreamChoice(delta=delta, finish_reason=finish)]
            return ChatCompletionChunk(id=rid, created=created, model=self.model_name,
                                       choices=choices, usage=usage).model_dump_json()

        if req.stream:
            return self.sse(stream, "chat", lambda e: chunk(e.text, e.finish_reason),
                            _usage_tail(chunk, len(ids), req.include_usage()))
        result = await self.collect(stream, raw, "chat")
        message = ChatDelta(role="assistant", content=result.text)
        return JSONResponse(ChatCompletionResponse(
            id=rid, created=created, model=self.model_name,
            choices=[ChatChoice(message=message, finish_reason=result.finish_reason)],
            usage=_usage(len(ids), result.num_tokens)).model_dump())

    # ---- plumbing ------------------------------------------------------------------
    def sse(self, stream: RequestStream, endpoint: str, render: Callable[[RequestEvent], str],
            tail: Callable[[int], str | None] = lambda _: None) -> StreamingResponse:
        """An SSE response: ``render(event)`` per token event, an error chunk if the
        request fails, ``tail(tokens)`` (if not None) once it finished, then ``[DONE]``.
        ``endpoint`` labels the request metric."""
        metrics = self.frontend.metrics
        trace = self.frontend.first_token_trace

        async def body() -> AsyncIterator[str]:
            outcome, num_tokens, written = "aborted", 0, False
            try:
                async with contextlib.aclosing(stream):
                    async for event in stream:
                        # one chunk per token event, but one write for every event
                        # queued by then: each write costs the loop the whole ASGI
                        # send path, more than rendering the events it carries
                        lines = []
                        for e in (event, *stream.ready()):
                            if e.error is not None:
                                outcome = "error"
                                lines.append(_sse_line(_error_json(e)))
                                break
                            num_tokens = e.num_generated
                            lines.append(_sse_line(render(e)))
                            if e.finish_reason is not None:
                                outcome = "finished"
                        yield "".join(lines)
                        if not written and num_tokens:  # resumed here: the chunk is out
                            written = True
                            trace.written(stream.request_id)
                        if outcome == "error":
                            break
                last = tail(num_tokens) if outcome == "finished" else None
                yield ("" if last is None else _sse_line(last)) + "data: [DONE]\n\n"
            finally:
                metrics.requests.labels(endpoint, outcome).inc()

        return DisconnectAwareStreamingResponse(body(), media_type="text/event-stream",
                                                headers={"Cache-Control": "no-cache"})

    async def collect(self, stream: RequestStream, raw: Request, endpoint: str) -> _Result:
        """Gather a whole result, aborting the request if the client disconnects."""

        async def gather() -> _Result:
            parts: list[str] = []
            async with contextlib.aclosing(stream):
                async for event in stream:
                    parts.append(event.text)
                    if event.finish_reason is not None:
                        return _Result("".join(parts), event.num_generated,
                                       event.finish_reason, event.error, event.refused)
            return _Result("".join(parts), 0, None, "stream ended early")

        task = asyncio.create_task(gather())
        gone = asyncio.create_task(_wait_disconnect(raw))
        try:
            done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not task.done():
                task.cancel()  # closes the stream, which aborts the request
        if task not in done:
            self.frontend.metrics.requests.labels(endpoint, "aborted").inc()
            logger.info("request %s: client disconnected; aborted", stream.request_id)
            raise OpenAIError(499, "client disconnected")
        result = task.result()
        outcome = "error" if result.error else "finished"
        self.frontend.metrics.requests.labels(endpoint, outcome).inc()
        if result.refused:  # the engine's own check of the request: the client's error
            raise OpenAIError(400, result.error or "request refused")
        if result.error:
            raise OpenAIError(500, result.error, type="server_error")
        return result


def _encode(tokenizer: Any, prompt: str) -> list[int]:
    return tokenizer.encode(prompt)


def _chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The prompt ids of chat ``messages`` (the model's chat template, then tokens)."""
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - jinja raises many types on bad input
        raise OpenAIError(400, f"chat template failed on these messages: {exc}",
                          param="messages") from exc
    return tokenizer.encode(text, add_special_tokens=False)


async def _wait_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


def _check_unicode(text: str, param: str) -> None:
    """Raises:
        OpenAIError: 400 when ``text`` is not valid Unicode (a lone surrogate: the
            tokenizer's TypeError made it a 500).
    """
    problem = unicode_problem(text)
    if problem:
        raise OpenAIError(400, f"{param} {problem}", param=param)


def _usage_tail(chunk: Callable[..., str], prompt_len: int,
                include_usage: bool) -> Callable[[int], str | None]:
    """The usage chunk after the last token, when the request asked for it."""
    return lambda n: chunk("", None, _usage(prompt_len, n)) if include_usage else None


def _usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens)


def _sse_line(data: str) -> str:
    return f"data: {data}\n\n"


def _error_json(event: RequestEvent) -> str:
    return json.dumps(error_body(event.error or "request failed",
                                 type="invalid_request_error" if event.refused
                                 else "server_error"))
