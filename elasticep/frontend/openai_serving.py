"""Completion and chat-completion handlers: tokenize, check, submit, stream or collect.

Streaming sends one SSE chunk per generated token (its text may be "" while a UTF-8
character or a possible stop string is incomplete), then an optional usage chunk, then
``data: [DONE]``. A non-streaming request that loses its client is aborted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from elasticep.engine.request import SamplingParams, TokenLogprobs
from elasticep.frontend.api_errors import OpenAIError, resolve_max_tokens
from elasticep.frontend.chat_tools import (
    call_deltas,
    finish_reason,
    reply_message,
    tool_parser,
    with_forced_call,
)
from elasticep.frontend.completion_choices import CompletionChoices, best_candidates
from elasticep.frontend.core import Frontend, RequestStream
from elasticep.frontend.logprobs_format import ChatLogprobs, chat_logprobs
from elasticep.frontend.merged_stream import MergedStream
from elasticep.frontend.openai_protocol import ChatCompletionRequest, CompletionRequest
from elasticep.frontend.openai_responses import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatStreamChoice,
    CompletionChoice,
    CompletionResponse,
    Usage,
    completion_chunk_renderer,
    new_id,
    now,
)
from elasticep.frontend.request_tracker import (
    DuplicateRequestError,
    NoRankAvailableError,
    RequestEvent,
)
from elasticep.frontend.response_streams import (
    RequestResult,
    collect_results,
    sse_response,
)
from elasticep.frontend.tokenizer import NoTokenizerError, TokenizerPool
from elasticep.frontend.tool_parsers import ToolCall
from elasticep.frontend_link import monotonic_us
from elasticep.models.config import SamplingDefaults
from elasticep.utils.text import unicode_problem

logger = logging.getLogger(__name__)

TOKENIZER_THREADS = 4  # a giant prompt holds one of these; the others go on
# Text prompts up to this many characters (about 800 tokens of the demo tokenizer, about
# a millisecond of CPU) are encoded on the loop, longer ones on the pool
# (TokenizerPool.run's inline). A pool thread's encode gives up the GIL and takes it
# back several times; while the loop thread is busy (a burst of arrivals) each retake
# waits for the loop to yield it, so a 256-token prompt (0.3-0.5 ms of CPU) took
# several ms on the pool beside a busy thread, and its result then queued behind the
# loop's callbacks (see tokenizer.py's TokenizerPool).
INLINE_PROMPT_CHARS = 4096


@dataclass(eq=False)
class OpenAIServing:
    """Serves /v1/completions and /v1/chat/completions on a :class:`Frontend`.

    Attributes:
        frontend: routes and streams requests.
        tokenizer: a transformers tokenizer (``encode``, ``decode``,
            ``apply_chat_template``, ``chat_template``).
        model_name: the name clients must send as ``model``.
        max_model_len: prompt + completion tokens must fit this (context and KV cache).
        sampling_defaults: the model's ``generation_config.json`` sampling values, for
            the fields a request leaves unset.
        tool_call_parser: the format of the model's tool calls (a key of
            :data:`~elasticep.frontend.tool_parsers.TOOL_CALL_PARSERS`); None: requests
            with ``tools`` get a 400.
        tokenizers: the pool that runs ``tokenizer`` (built from it).
    """

    frontend: Frontend
    tokenizer: Any
    model_name: str
    max_model_len: int
    sampling_defaults: SamplingDefaults = SamplingDefaults()
    tool_call_parser: str | None = None
    tokenizers: TokenizerPool = field(init=False)

    def __post_init__(self) -> None:
        # Tokenizing a long prompt (or rendering a chat template) can take seconds: it
        # runs off the event loop, so that the other requests' streams, their checks and
        # /health go on meanwhile, and on a pool, so that it holds up one thread only.
        self.tokenizers = TokenizerPool(self.tokenizer, TOKENIZER_THREADS)

    # ---- request preparation -------------------------------------------------------
    def check_model(self, model: str) -> None:
        """Raises:
            OpenAIError: 404 ``model_not_found`` unless ``model`` is the served name.
        """
        if model != self.model_name:
            raise OpenAIError(404, f"The model `{model}` does not exist; this server serves "
                              f"`{self.model_name}`.", param="model", code="model_not_found")

    async def _completion_inputs(self, req: CompletionRequest,
                                 ) -> list[tuple[list[int], list[SamplingParams]]]:
        """Each prompt's ids and the params of its ``best_of`` (else ``n``) candidates
        (candidate j seeded ``seed + j``); ``max_tokens`` 0 (echo only) runs 1 token,
        which is dropped."""
        self.check_model(req.model)
        req.check_supported()
        out = []
        prompts = req.prompts()
        # a batch encodes on the loop only as much text as one prompt may: a list of
        # many prompts each under the limit would hold the loop for all of them
        may_inline = sum(len(p) for p in prompts if isinstance(p, str)) <= INLINE_PROMPT_CHARS
        for i, prompt in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt.{i}"
            ids = await self.encode_prompt(prompt, where, may_inline)
            max_tokens = resolve_max_tokens(len(ids), req.max_tokens or (
                None if req.max_tokens is None else 1), self.max_model_len)
            out.append((ids, [self.check_token_ids(
                req.to_sampling_params(max_tokens, self.sampling_defaults, j))
                for j in range(req.draws)]))
        return out

    def check_token_ids(self, params: SamplingParams, prefix: str = "") -> SamplingParams:
        """``params``, once its ``stop_token_ids`` and ``logit_bias`` name tokens of the
        vocabulary.

        Raises:
            OpenAIError: 400 naming the field (after ``prefix``) otherwise.
        """
        vocab = len(self.tokenizer)
        for name, ids in (("stop_token_ids", params.stop_token_ids),
                          ("logit_bias", [t for t, _ in params.logit_bias])):
            if any(not 0 <= t < vocab for t in ids):
                raise OpenAIError(400, f"{prefix}{name} token ids must be in [0, {vocab})",
                                  param=f"{prefix}{name}")
        return params

    async def encode_prompt(self, prompt: str | list[int], param: str,
                            may_inline: bool = True) -> list[int]:
        """The token ids of a text prompt or of an id list (checked against the
        vocabulary). A text prompt of at most ``INLINE_PROMPT_CHARS`` characters is
        encoded on the event loop where ``may_inline``, a longer one in the tokenizer
        pool.

        Raises:
            OpenAIError: 400 naming ``param`` for invalid Unicode, a text prompt to a
                model without a tokenizer, an id out of range, or an empty prompt.
        """
        if isinstance(prompt, str):
            _check_unicode(prompt, param)
            try:
                ids = list(await self.tokenizers.run(
                    _encode, prompt, inline=may_inline and len(prompt) <= INLINE_PROMPT_CHARS))
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
        messages = [m.for_template() for m in req.messages]
        for i, m in enumerate(messages):
            _check_unicode(m["content"], f"messages.{i}.content")
        tools = req.tools_for_template()
        # a short chat without tools renders and encodes on the loop, as a short prompt
        # does (INLINE_PROMPT_CHARS); tool schemas make the template's work open-ended
        inline = tools is None and sum(len(m["content"]) for m in messages) <= INLINE_PROMPT_CHARS
        ids = list(await self.tokenizers.run(_chat_ids, messages, tools, inline=inline))
        max_tokens = resolve_max_tokens(len(ids), req.requested_max_tokens(),
                                        self.max_model_len, req.max_tokens_param())
        return ids, self.check_token_ids(req.to_sampling_params(max_tokens,
                                                                self.sampling_defaults))

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
        """POST /v1/completions: every prompt times ``n`` choices (:mod:`completion_choices`)."""
        arrived = monotonic_us()
        inputs = await self._completion_inputs(req)
        rid, created = new_id("cmpl"), now()
        choices = CompletionChoices(req, inputs, self.token_text, self.tokenizer.decode)
        streams = self.submit_all(
            [f"{rid}-{k}" if choices.many else rid for k in range(choices.count)],
            choices.requests(), arrived)
        prompt_tokens = sum(len(ids) for ids, _ in inputs)

        def chunk(text: str, finish: str | None, usage: Usage | None = None) -> str:
            choices = [] if usage else [CompletionChoice(text=text, finish_reason=finish)]
            return CompletionResponse(id=rid, created=created, model=self.model_name,
                                      choices=choices, usage=usage).model_dump_json()

        if req.stream:
            tail = _usage_tail(chunk, prompt_tokens, req.include_usage(),
                               0 if choices.echo_only else None)
            if choices.plain:
                render = completion_chunk_renderer(rid, created, self.model_name)
                return self.sse(streams[0], "completions",
                                lambda e: render(e.text, e.finish_reason), tail)
            index = {s.request_id: k for k, s in enumerate(streams)}

            def render_choice(e: RequestEvent) -> str:
                return CompletionResponse(id=rid, created=created, model=self.model_name,
                                          choices=[choices.streamed(index[e.request_id], e)],
                                          ).model_dump_json()

            return self.sse(MergedStream(streams), "completions", render_choice, tail)
        results = await self.collect_many(streams, raw, "completions")
        kept = best_candidates(results, req.draws, req.n)
        return JSONResponse(CompletionResponse(
            id=rid, created=created, model=self.model_name,
            choices=[choices.whole(k, r.text, r.finish_reason, r.logprobs, r.prompt_logprobs,
                                   index=i) for i, (k, r) in enumerate(kept)],
            usage=_usage(prompt_tokens, 0 if choices.echo_only
                         else sum(r.num_tokens for _, r in kept))).model_dump())

    def submit_all(self, request_ids: list[str],
                   requests: list[tuple[list[int], SamplingParams]],
                   arrived_us: int | None = None) -> list[RequestStream]:
        """:meth:`submit` each request (all arrived at ``arrived_us``: one HTTP request);
        if one fails, those already routed are aborted.

        Raises:
            OpenAIError: as :meth:`submit`.
        """
        streams: list[RequestStream] = []
        try:
            for rid, (ids, params) in zip(request_ids, requests, strict=True):
                streams.append(self.submit(rid, ids, params, arrived_us))
        except BaseException:
            for s in streams:
                s.close_now()
            raise
        return streams

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        """POST /v1/chat/completions."""
        arrived = monotonic_us()
        parser = tool_parser(req, self.tool_call_parser, self.model_name)
        ids, params = await self._chat_inputs(req)
        params = with_forced_call(req, self.tool_call_parser, params)
        rid, created = new_id("chatcmpl"), now()
        stream = self.submit(rid, ids, params, arrived)
        first = [True]

        def logprobs(lps: Sequence[TokenLogprobs]) -> ChatLogprobs | None:
            if params.logprobs is None:
                return None
            return chat_logprobs(self.token_text, lps, params.logprobs)

        def chunk(text: str, finish: str | None, usage: Usage | None = None,
                  calls: list[ToolCall] | None = None,
                  lps: Sequence[TokenLogprobs] = ()) -> str:
            choices = []
            if usage is None:
                # the role rides on the first token's chunk: still one chunk per token
                delta = ChatDelta(role="assistant" if first[0] else None, content=text,
                                  tool_calls=call_deltas(calls, parser) if calls else None)
                first[0] = False
                choices = [ChatStreamChoice(delta=delta, finish_reason=finish,
                                            logprobs=logprobs(lps))]
            return ChatCompletionChunk(id=rid, created=created, model=self.model_name,
                                       choices=choices, usage=usage).model_dump_json()

        def render(e: RequestEvent) -> str:
            if parser is None:
                return chunk(e.text, e.finish_reason, lps=e.logprobs)
            text, calls = parser.push(e.text)
            if e.finish_reason is not None:
                more, last = parser.finish()
                text, calls = text + more, calls + last
            return chunk(text, finish_reason(e.finish_reason, parser), calls=calls,
                         lps=e.logprobs)

        if req.stream:
            return self.sse(stream, "chat", render,
                            _usage_tail(chunk, len(ids), req.include_usage()))
        result = await self.collect(stream, raw, "chat")
        return JSONResponse(ChatCompletionResponse(
            id=rid, created=created, model=self.model_name,
            choices=[ChatChoice(message=reply_message(result.text, parser),
                                finish_reason=finish_reason(result.finish_reason, parser),
                                logprobs=logprobs(result.logprobs))],
            usage=_usage(len(ids), result.num_tokens)).model_dump())

    # ---- plumbing ------------------------------------------------------------------
    def sse(self, stream: RequestStream | MergedStream, endpoint: str,
            render: Callable[[RequestEvent], str | None],
            tail: Callable[[int], str | None] = lambda _: None) -> StreamingResponse:
        """:func:`~elasticep.frontend.response_streams.sse_response` on this front-end's
        metrics and first-token trace."""
        return sse_response(stream, endpoint, render, tail, self.frontend.metrics,
                            self.frontend.first_token_trace)

    async def collect(self, stream: RequestStream, raw: Request, endpoint: str,
                      ) -> RequestResult:
        """Gather a whole result, aborting the request if the client disconnects."""
        return (await self.collect_many([stream], raw, endpoint))[0]

    async def collect_many(self, streams: list[RequestStream], raw: Request,
                           endpoint: str) -> list[RequestResult]:
        """:func:`~elasticep.frontend.response_streams.collect_results` on this
        front-end's metrics."""
        return await collect_results(streams, raw, endpoint, self.frontend.metrics)

    def token_text(self, token_id: int) -> str:
        """One token's text, as logprobs show it (its decode alone)."""
        return self.tokenizer.decode([token_id])


def _encode(tokenizer: Any, prompt: str) -> list[int]:
    return tokenizer.encode(prompt)


def _chat_ids(tokenizer: Any, messages: list[dict[str, Any]],
              tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The prompt ids of chat ``messages`` (the model's chat template, given ``tools``,
    then tokens)."""
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - jinja raises many types on bad input
        raise OpenAIError(400, f"chat template failed on these messages: {exc}",
                          param="messages") from exc
    return tokenizer.encode(text, add_special_tokens=False)


def _check_unicode(text: str, param: str) -> None:
    """Raises:
        OpenAIError: 400 when ``text`` is not valid Unicode (a lone surrogate: the
            tokenizer's TypeError made it a 500).
    """
    problem = unicode_problem(text)
    if problem:
        raise OpenAIError(400, f"{param} {problem}", param=param)


def _usage_tail(chunk: Callable[..., str], prompt_len: int, include_usage: bool,
                completion_tokens: int | None = None) -> Callable[[int], str | None]:
    """The usage chunk after the last token, when the request asked for it (with
    ``completion_tokens`` in place of the tokens generated, when not None)."""
    return lambda n: (chunk("", None, _usage(prompt_len, n if completion_tokens is None
                                                          else completion_tokens))
                      if include_usage else None)


def _usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens)
