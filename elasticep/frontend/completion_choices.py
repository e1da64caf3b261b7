"""The choices of one ``/v1/completions`` request: prompts times ``n``, echo, logprobs.

Choice ``k`` is prompt ``k // n``'s ``(k % n)``-th sample (vLLM's order). With
``best_of`` above ``n``, ``best_of`` candidates are drawn per prompt and the ``n`` with
the highest cumulative logprob are returned, best first (vLLM's definition). With ``echo``
a choice's text starts with its prompt (the client's string, or the decode of its
ids), and with ``logprobs`` too its logprobs start with the prompt's tokens, the first
one with ``None``. ``max_tokens`` 0 with ``echo`` scores the prompt only: the rank draws
one token, which is left out of the text, the logprobs and the usage (as vLLM does).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from elasticep.engine.request import SamplingParams, TokenLogprobs
from elasticep.frontend.logprobs_format import CompletionLogprobs, TokenText, completion_logprobs
from elasticep.frontend.openai_protocol import CompletionRequest
from elasticep.frontend.openai_responses import CompletionChoice
from elasticep.frontend.request_tracker import RequestEvent

T = TypeVar("T", bound=Any)  # a result with ``logprobs``


class CompletionChoices:
    """Builds the choices of one request, whole or one streamed event at a time.

    Args:
        req: the request (checked).
        inputs: per prompt, its token ids and the params of its ``n`` choices.
        token_text: id -> one token's text (logprobs).
        decode: ids -> text (an echoed prompt sent as ids).
    """

    def __init__(self, req: CompletionRequest,
                 inputs: Sequence[tuple[list[int], list[SamplingParams]]],
                 token_text: TokenText, decode: Callable[[list[int]], str]) -> None:
        self.req = req
        self.inputs = inputs
        self.n = req.draws  # candidates per prompt
        self.count = len(inputs) * self.n
        self.many = self.count > 1
        self.echo_only = req.echo and req.max_tokens == 0
        # one choice, nothing added to its text: the fast streaming renderer serves it
        self.plain = not self.many and not req.echo and req.logprobs is None
        self._token_text = token_text
        self._prompt_texts = ([p if isinstance(p, str) else decode(ids)
                               for p, (ids, _) in zip(req.prompts(), inputs, strict=True)]
                              if req.echo else [])
        self._offsets: dict[int, int] = {}  # choice -> text_offset of its next token

    def requests(self) -> list[tuple[list[int], SamplingParams]]:
        """``(prompt ids, params)`` of every choice, in choice order."""
        return [(ids, p) for ids, params in self.inputs for p in params]

    def whole(self, k: int, text: str, finish_reason: str | None,
              logprobs: Sequence[TokenLogprobs],
              prompt_logprobs: Sequence[TokenLogprobs] | None,
              index: int | None = None) -> CompletionChoice:
        """Candidate ``k`` from its whole result, as the choice ``index`` (default k)."""
        choice = self._choice(k, text, finish_reason, logprobs, prompt_logprobs, True)
        return choice if index is None else choice.model_copy(update={"index": index})

    def streamed(self, k: int, event: RequestEvent) -> CompletionChoice:
        """Choice ``k``'s chunk for one of its events (its first also carries the echo)."""
        first = k not in self._offsets
        return self._choice(k, event.text, event.finish_reason, event.logprobs,
                            event.prompt_logprobs, first)

    def _choice(self, k: int, text: str, finish_reason: str | None,
                logprobs: Sequence[TokenLogprobs],
                prompt_logprobs: Sequence[TokenLogprobs] | None,
                with_echo: bool) -> CompletionChoice:
        lps = list(logprobs)
        if self.echo_only:
            text, lps = "", []
            finish_reason = None if finish_reason is None else "length"
        first_token = None
        if self.req.echo and with_echo:
            ids = self.inputs[k // self.n][0]
            text = self._prompt_texts[k // self.n] + text
            lps = list(prompt_logprobs or ()) + lps
            first_token = ids[0]
        out: CompletionLogprobs | None = None
        if self.req.logprobs is not None:
            out = completion_logprobs(self._token_text, lps, first_token,
                                      self._offsets.get(k, 0))
            if out.tokens:
                self._offsets[k] = out.text_offset[-1] + len(out.tokens[-1])
        self._offsets.setdefault(k, 0)
        return CompletionChoice(index=k, text=text, finish_reason=finish_reason, logprobs=out)


def best_candidates(results: Sequence[T], draws: int, n: int,
                    ) -> list[tuple[int, T]]:
    """``(candidate index, result)`` of the ``n`` best of each prompt's ``draws``
    candidates, by the sum of their tokens' logprobs (ties: the earlier), prompts in
    order; all of them, in order, when ``draws == n``.

    Args:
        results: ``[prompts * draws]`` with a ``logprobs`` list each.
    """
    out: list[tuple[int, T]] = []
    for start in range(0, len(results), draws):
        cands = list(enumerate(results[start:start + draws], start))
        if draws > n:
            cands = sorted(cands, key=lambda c: -sum(t.logprob for t in c[1].logprobs))[:n]
        out += cands
    return out

