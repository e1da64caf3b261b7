"""Typed request/response messages shared by the engine, the workers and the front-end.

These are small frozen dataclasses (mini-sglang style). The two the front-end sends a
rank, `GenerateRequest` and `AbortRequest`, are :class:`elasticep.wire.Message` types
and travel as checked JSON (`elasticep.frontend_link`); `SamplingParams` and
`TokenOutput` travel inside messages. The single-process engine uses them unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from elasticep.wire import Message
from elasticep.wire import values as wire_values

# The sampler scales logits in float32 whatever the model's dtype (engine/sampler.py), so
# a temperature below float32's smallest normal (2**-126) would be 0 or lose its precision
# there; ids and seeds travel as int64 (vLLM bounds ``seed`` to int64 the same way).
MIN_TEMPERATURE = 2.0**-126
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# vLLM's default ``max_logprobs`` and OpenAI's cap on ``top_logprobs``: a rank computes at
# most this many alternatives per token
MAX_LOGPROBS = 20
# OpenAI's range of a ``logit_bias`` value
MAX_LOGIT_BIAS = 100.0


# the grammar kinds of structured output: OpenAI's response_format types json_schema
# and json_object, and SGLang's regex and ebnf
GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "ebnf")


@dataclass(frozen=True)
class GrammarSpec:
    """A structured-output constraint (:mod:`elasticep.engine.grammar`).

    Attributes:
        kind: one of :data:`GRAMMAR_KINDS`.
        spec: the JSON schema (JSON text), the regex or the EBNF; "" for json_object.
    """

    kind: str
    spec: str = ""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings, named as in the OpenAI API.

    Attributes:
        max_tokens: number of tokens to generate at most (>= 1).
        temperature: softmax temperature; 0 means greedy (argmax).
        top_p: nucleus mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 disables it (any k >= vocab does too).
        seed: seed of the counter-based RNG (an int64); None means "derive from
            request id".
        stop: stop strings; generation ends when the decoded text contains one (empty
            strings are ignored, as the front-end's detokenizer does).
        ignore_eos: keep generating after EOS (``stop_token_ids`` still stop).
        frequency_penalty: subtracted from a token's logit once per time it occurs in
            the output so far, in [-2, 2] (OpenAI's and vLLM's meaning).
        presence_penalty: subtracted from the logit of every token that occurs in the
            output so far, in [-2, 2].
        repetition_penalty: > 0; a token that occurs in the prompt or the output so far
            has its logit divided by it when positive, multiplied when negative (vLLM's
            and SGLang's meaning, from CTRL); 1 disables it.
        min_p: drop tokens whose probability (after temperature) is below ``min_p``
            times the top token's, in [0, 1]; 0 disables it. Not applied to greedy rows.
        min_tokens: EOS and ``stop_token_ids`` cannot be drawn before this many output
            tokens (<= ``max_tokens``).
        stop_token_ids: token ids that end the request with finish_reason "stop" (the
            token is kept in the output ids).
        logit_bias: ``(token id, bias)`` pairs added to the raw logits, each bias in
            [-100, 100] (OpenAI's range).
        logprobs: None: no logprobs; k >= 0: each output token's logprob and the k most
            likely alternatives (at most :data:`MAX_LOGPROBS`).
        prompt_logprobs: None, or k >= 0: the logprob of every prompt token after the
            first, with k alternatives each (``echo`` in the completions API).
        skip_special_tokens, spaces_between_special_tokens: how the front-end
            detokenizes the output (the ranks ignore them).
        grammar: structured output: every token obeys this grammar, and the request
            ends once the grammar is complete (even with ``ignore_eos``); None: free.

    Raises:
        ValueError: from :meth:`validate` when a field is out of range.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    grammar: GrammarSpec | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    @property
    def needs_processing(self) -> bool:
        """True when the raw logits must be changed before sampling (penalties, bias,
        ``min_tokens``): :mod:`elasticep.engine.logits_processing`."""
        return (self.frequency_penalty != 0 or self.presence_penalty != 0
                or self.repetition_penalty != 1 or self.min_tokens > 0
                or bool(self.logit_bias))

    def validate(self) -> None:
        """Raise :class:`SamplingParamError` (a ValueError) naming the first bad field.

        Every value that passes is one the sampler computes: a finite temperature that is
        0 or at least :data:`MIN_TEMPERATURE`, a top_p in (0, 1], an int64 seed.
        """
        t = self.temperature
        checks = (
            ("max_tokens", self.max_tokens >= 1, "must be >= 1"),
            ("temperature", math.isfinite(t) and t >= 0, "must be a finite number >= 0"),
            ("temperature", not 0 < t < MIN_TEMPERATURE,
             f"must be 0 (greedy) or at least {MIN_TEMPERATURE:.3g} (the sampler scales "
             "logits in float32)"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),  # False for NaN too
            ("top_k", self.top_k >= 0, "must be >= 0"),
            ("seed", self.seed is None or INT64_MIN <= self.seed <= INT64_MAX,
             "must be a 64-bit signed integer"),
            ("grammar", self.grammar is None or self.grammar.kind in GRAMMAR_KINDS,
             f"kind must be one of {', '.join(GRAMMAR_KINDS)}"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("repetition_penalty", 0 < self.repetition_penalty < math.inf,
             "must be a finite number > 0"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("min_tokens", 0 <= self.min_tokens <= self.max_tokens,
             f"must be in [0, max_tokens={self.max_tokens}]"),
            ("stop_token_ids", all(0 <= t <= INT64_MAX for t in self.stop_token_ids),
             "must be token ids >= 0"),
            ("logit_bias", all(0 <= t <= INT64_MAX and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS
                               for t, b in self.logit_bias),
             f"must map token ids >= 0 to biases in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"must be in [0, {MAX_LOGPROBS}]"),
            ("prompt_logprobs",
             self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
             f"must be in [0, {MAX_LOGPROBS}]"),
        )
        for name, ok, rule in checks:
            if not ok:
                raise SamplingParamError(name, f"{name} {rule}, got {getattr(self, name)}")


class SamplingParamError(ValueError):
    """A sampling field is out of the range the engine computes.

    Attributes:
        param: the field's name (as in the OpenAI API).
    """

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class GenerateRequest(Message, tag="generate"):
    """A request sent to one data-parallel rank.

    ``output_token_ids`` is non-empty when a request is resumed on a survivor after
    its rank died: the rank continues from prompt + these tokens, and the counter-based
    RNG (seed, request id, token index) makes the continuation identical.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    output_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class AbortRequest(Message, tag="abort"):
    """Ask a rank to drop a request (client disconnected, or stop string hit)."""

    request_id: str


@dataclass(frozen=True)
class TokenLogprobs:
    """The log-probability of one token and its most likely alternatives.

    Computed on the rank from the raw logits of the forward (float32 log-softmax over
    the vocabulary, before logit bias, penalties, temperature and filters: vLLM's
    default ``raw_logprobs``).

    Attributes:
        token_id: the token (sampled, or the prompt's).
        logprob: its natural-log probability.
        top: ``(token id, logprob)`` of the k most likely tokens, most likely first.
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class TokenOutput:
    """One generated token. ``index`` is its position among the request's outputs.

    ``finish_reason`` is None while the request runs, else "length", "stop" or "abort".
    Consumers deduplicate by (request_id, index), so a redone step never streams a
    token twice. ``error`` is set (with "abort" and ``token_id`` None) when the rank
    failed this one request, for example its sampling raised: the request ends with
    that error and the rank goes on with the others. ``logprobs`` is set when the
    request asked for them; ``prompt_logprobs`` (prompt positions 1..P-1) rides on the
    first output a request's rank publishes without resumed tokens.
    """

    request_id: str
    index: int
    token_id: int | None
    finish_reason: str | None = None
    error: str | None = None
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None


# A step's tokens travel as rows ``[request_id, index, token_id, finish_reason, error]``
# (the per-token hot path: no repeated keys); a token with logprobs appends its
# ``logprobs`` and ``prompt_logprobs`` as two more items.
_ROW_TYPES = ((str,), (int,), (int, type(None)), (str, type(None)), (str, type(None)))


def _token_output_row(o: TokenOutput) -> list:
    row = [o.request_id, o.index, o.token_id, o.finish_reason, o.error]
    if o.logprobs is not None or o.prompt_logprobs is not None:
        row += [wire_values.plain(o.logprobs), wire_values.plain(o.prompt_logprobs)]
    return row


def _token_output_from_row(row: object) -> TokenOutput:
    """Raises:
        TypeError / ValueError: not a row of :class:`TokenOutput`.
    """
    if type(row) is not list or len(row) not in (5, 7):
        raise ValueError("a token output is a row of 5 or 7 items")
    if not all(type(v) in kinds for v, kinds in zip(row, _ROW_TYPES, strict=False)):
        raise TypeError("a token output row has a mistyped field")
    logprobs = prompt = None
    if len(row) == 7:
        logprobs = wire_values.convert(row[5], TokenLogprobs | None, "logprobs", {})
        prompt = wire_values.convert(row[6], tuple[TokenLogprobs, ...] | None, "prompt_logprobs", {})
    return TokenOutput(row[0], row[1], row[2], row[3], row[4], logprobs, prompt)


wire_values.register_codec(TokenOutput, _token_output_row, _token_output_from_row)

