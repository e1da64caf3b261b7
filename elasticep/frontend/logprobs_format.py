"""Logprobs as each API returns them, from the ranks' :class:`TokenLogprobs` (pure).

- completions (OpenAI's legacy shape, as vLLM): ``{"tokens", "token_logprobs",
  "top_logprobs", "text_offset"}``, one entry per token; with ``echo`` the prompt's
  tokens come first, the first of them with ``None`` (nothing predicts it);
- chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``;
- SGLang's ``/generate``: ``meta_info.output_token_logprobs`` as ``[logprob, id, text]``
  triples and ``output_top_logprobs`` as lists of them (``input_...`` for the prompt).

``token_text(id)`` is one token's text, as vLLM shows it: the tokenizer's decode of that
id alone (a byte-level piece of a UTF-8 character decodes to U+FFFD).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel

from elasticep.engine.request import TokenLogprobs

TokenText = Callable[[int], str]


class CompletionLogprobs(BaseModel):
    """``choices[i].logprobs`` of a completion."""

    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    """``choices[i].logprobs`` of a chat completion."""

    content: list[ChatTokenLogprob] | None


def completion_logprobs(token_text: TokenText, tokens: Sequence[TokenLogprobs],
                        first_token: int | None = None, start_offset: int = 0,
                        ) -> CompletionLogprobs:
    """The completions shape of ``tokens`` (in order).

    Args:
        token_text: id -> its text.
        tokens: the logprobs of each token.
        first_token: a token to put first with ``None`` logprobs (an echoed prompt's
            first token), or None.
        start_offset: ``text_offset`` of the first token (characters).
    """
    out = CompletionLogprobs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])
    offset = start_offset

    def add(text: str, logprob: float | None, top: dict[str, float] | None) -> None:
        nonlocal offset
        out.tokens.append(text)
        out.token_logprobs.append(logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(text)

    if first_token is not None:
        add(token_text(first_token), None, None)
    for t in tokens:
        top = {token_text(i): v for i, v in t.top}
        # vLLM lists the chosen token too when it is not among the top k
        top.setdefault(token_text(t.token_id), t.logprob)
        add(token_text(t.token_id), t.logprob, top)
    return out


def chat_logprobs(token_text: TokenText, tokens: Sequence[TokenLogprobs],
                  num_top: int) -> ChatLogprobs:
    """The chat shape of ``tokens``, with ``num_top`` alternatives each."""

    def entry(i: int, v: float) -> ChatTopLogprob:
        text = token_text(i)
        return ChatTopLogprob(token=text, logprob=v, bytes=list(text.encode()))

    return ChatLogprobs(content=[
        ChatTokenLogprob(**entry(t.token_id, t.logprob).model_dump(),
                         top_logprobs=[entry(i, v) for i, v in t.top[:num_top]])
        for t in tokens])


def sglang_logprobs(token_text: TokenText | None, tokens: Sequence[TokenLogprobs],
                    ) -> tuple[list[list[Any]], list[list[list[Any]]]]:
    """SGLang's ``(token_logprobs, top_logprobs)``: ``[logprob, id, text]`` per token
    (``text`` None unless ``token_text`` is given: ``return_text_in_logprobs``)."""

    def triple(i: int, v: float | None) -> list[Any]:
        return [v, i, None if token_text is None else token_text(i)]

    return ([triple(t.token_id, t.logprob) for t in tokens],
            [[triple(i, v) for i, v in t.top] for t in tokens])
