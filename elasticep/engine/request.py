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

# The sampler scales logits in float32 whatever the model's dtype (engine/sampler.py), so
# a temperature below float32's smallest normal (2**-126) would be 0 or lose its precision
# there; ids and seeds travel as int64 (vLLM bounds ``seed`` to int64 the same way).
MIN_TEMPERATURE = 2.0**-126
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


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
        ignore_eos: keep generating after EOS.
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
class TokenOutput:
    """One generated token. ``index`` is its position among the request's outputs.

    ``finish_reason`` is None while the request runs, else "length", "stop" or "abort".
    Consumers deduplicate by (request_id, index), so a redone step never streams a
    token twice. ``error`` is set (with "abort" and ``token_id`` None) when the rank
    failed this one request, for example its sampling raised: the request ends with
    that error and the rank goes on with the others.
    """

    request_id: str
    index: int
    token_id: int | None
    finish_reason: str | None = None
    error: str | None = None
