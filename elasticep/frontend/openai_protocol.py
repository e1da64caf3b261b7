"""OpenAI-compatible request models (completions and chat completions).

Requests are strict: an unknown field is a 400, and so is a known OpenAI field whose
non-default value we do not implement (``suffix``, chat's ``n > 1``), so a client never silently gets something other than what it asked for.
vLLM's sampling extensions (``repetition_penalty``, ``min_p``, ``min_tokens``,
``stop_token_ids``, ``skip_special_tokens``, ``spaces_between_special_tokens``,
``ignore_eos``, ``top_k``) are taken under vLLM's names. Errors are
:class:`~elasticep.frontend.api_errors.OpenAIError`; the responses are in
:mod:`elasticep.frontend.openai_responses`.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field, model_validator

from elasticep.engine.request import GrammarSpec, SamplingParams
from elasticep.frontend.api_errors import OpenAIError, checked_grammar
from elasticep.frontend.openai_tools import (
    NamedToolChoice,
    ResponseFormat,
    Tool,
    ToolCallIn,
)
from elasticep.frontend.sampling_fields import SharedSamplingFields, Strict, validated
from elasticep.models.config import SamplingDefaults


class StreamOptions(Strict):
    include_usage: bool = False


class _SamplingFields(SharedSamplingFields):
    """Fields shared by both endpoints; unsupported ones accept only their default."""

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_k: int = Field(0, ge=-1, description="extension; 0 or -1 disables it")
    # OpenAI's own bound on n: more would let one request occupy every rank's slots
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    user: str | None = None
    min_tokens: int = 0
    # structured output: OpenAI's own form (regex and ebnf are SGLang's extensions)
    response_format: ResponseFormat | None = None

    # field -> the only value we implement; anything else is a 400 naming the field
    UNSUPPORTED: ClassVar[dict[str, Any]] = {}
    # an engine field's name -> the request field it comes from, for error messages
    PARAM_NAMES: ClassVar[dict[str, str]] = {}
    # fields whose JSON null means "not sent", as in OpenAI's API and vLLM (clients that
    # serialise every field send them): the default, or the model's, then applies
    NULL_IS_UNSET: ClassVar[tuple[str, ...]] = (
        "temperature", "top_p", "top_k", "n", "stream", "presence_penalty",
        "frequency_penalty", "repetition_penalty", "min_p", "min_tokens",
        "skip_special_tokens", "spaces_between_special_tokens", "ignore_eos", "max_tokens",
        "max_completion_tokens", "echo", "logprobs")

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

    def grammar_spec(self) -> GrammarSpec | None:
        """The structured-output constraint the request asks for, parsed; None: free text.

        Raises:
            OpenAIError: 400 naming the field: two constraints at once, a json_schema
                format without a schema, or a schema / regex / EBNF that does not parse.
        """
        asked = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            asked.append(("response_format", GrammarSpec("json_object")))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise OpenAIError(400, 'response_format of type "json_schema" needs '
                                  "json_schema.schema", param="response_format")
            asked.append(("response_format", GrammarSpec(
                "json_schema", json.dumps(fmt.json_schema.schema_))))
        for name in ("regex", "ebnf"):
            if getattr(self, name) is not None:
                asked.append((name, GrammarSpec(name, getattr(self, name))))
        if not asked:
            return None
        if len(asked) > 1:
            raise OpenAIError(400, f"send one structured-output constraint, not "
                              f"{' and '.join(n for n, _ in asked)}", param=asked[1][0])
        name, spec = asked[0]
        return checked_grammar(spec, name)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """``(logprobs, prompt_logprobs)`` of the engine's params (None: not asked)."""
        return None, None

    def to_sampling_params(self, max_tokens: int,
                           defaults: SamplingDefaults = SamplingDefaults(),
                           seed_offset: int = 0) -> SamplingParams:
        """Engine sampling params with the resolved ``max_tokens``.

        Args:
            max_tokens: completion tokens.
            defaults: the model's ``generation_config.json`` values, used for the
                sampling fields the request does not send (then OpenAI's defaults).
            seed_offset: added to ``seed`` (choice ``j`` of ``n`` draws with ``seed + j``,
                as vLLM's, so that seeded choices differ).

        Raises:
            OpenAIError: 400 when a value is out of the engine's range.
        """
        logprobs, prompt_logprobs = self.logprob_counts()
        return validated(SamplingParams(
            max_tokens=max_tokens,
            temperature=self.model_default("temperature", defaults),
            top_k=max(self.model_default("top_k", defaults), 0),
            seed=None if self.seed is None else self.seed + seed_offset,
            min_tokens=self.min_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            **self.shared_params(defaults), grammar=self.grammar_spec(),
        ), lambda param: self.PARAM_NAMES.get(param, param))


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. ``prompt`` is text or token ids, or a batch of either: each
    prompt gets ``n`` choices, choice ``i * n + j`` being prompt i's j-th (vLLM's order).

    ``echo`` puts the prompt before each choice's text (and, with ``logprobs``, the
    prompt tokens' logprobs first); ``max_tokens`` 0 is allowed with ``echo`` only, to
    score a prompt (lm-eval-harness's loglikelihood requests).
    """

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0)
    best_of: int | None = Field(None, le=128)  # below n: a 400 (check_supported)
    suffix: str | None = None

    UNSUPPORTED: ClassVar[dict[str, Any]] = {**_SamplingFields.UNSUPPORTED, "suffix": None}
    PARAM_NAMES: ClassVar[dict[str, str]] = {"prompt_logprobs": "logprobs"}

    def check_supported(self) -> None:
        """As :meth:`_SamplingFields.check_supported`, and ``best_of`` as vLLM defines it
        (draw ``best_of`` candidates per prompt, return the ``n`` with the highest
        cumulative logprob): at least ``n``, and not streamed when above it.

        Raises:
            OpenAIError: 400 naming the field.
        """
        super().check_supported()
        if self.best_of is not None and self.best_of < self.n:
            raise OpenAIError(400, f"best_of must be >= n ({self.n}), got {self.best_of}",
                              param="best_of")
        if self.draws > self.n and self.stream:
            raise OpenAIError(400, "best_of above n cannot be streamed (the best are known "
                              "only at the end)", param="best_of")
        if self.max_tokens == 0 and not self.echo:
            raise OpenAIError(400, "max_tokens must be >= 1 (0 only with echo, to score the "
                              "prompt)", param="max_tokens")

    @property
    def draws(self) -> int:
        """Candidates drawn per prompt: ``best_of``, else ``n``."""
        return self.best_of or self.n

    def logprob_counts(self) -> tuple[int | None, int | None]:
        # best_of ranks candidates by their tokens' logprobs: the ranks compute them
        logprobs = 0 if self.logprobs is None and self.draws > self.n else self.logprobs
        return logprobs, self.logprobs if self.echo else None

    def prompts(self) -> list[str | list[int]]:
        """Every prompt of the request (a single one is a batch of one).

        Raises:
            OpenAIError: 400 for an empty batch or an empty prompt.
        """
        prompt: Any = self.prompt
        batch = (prompt if isinstance(prompt, list) and prompt
                 and isinstance(prompt[0], str | list) else [prompt])
        if not batch:
            raise OpenAIError(400, "prompt must not be empty", param="prompt")
        for i, p in enumerate(batch):
            if len(p) == 0:
                where = "prompt" if len(batch) == 1 else f"prompt.{i}"
                raise OpenAIError(400, f"{where} must not be empty", param=where)
        return batch


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns: the call this answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as a chat template reads it (tool fields only where set)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        for key in ("tool_call_id", "name"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)

    UNSUPPORTED: ClassVar[dict[str, Any]] = {**_SamplingFields.UNSUPPORTED, "n": 1}
    PARAM_NAMES: ClassVar[dict[str, str]] = {"logprobs": "top_logprobs"}

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """Raises:
            OpenAIError: 400 for ``top_logprobs`` without ``logprobs`` (OpenAI's rule).
        """
        if self.top_logprobs and not self.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None, None

    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def tools_for_template(self) -> list[dict[str, Any]] | None:
        """The tool definitions the chat template renders; None without tools or with
        ``tool_choice`` "none" (the model is then not told of them)."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def max_tokens_param(self) -> str:
        """The field :meth:`requested_max_tokens` came from, for error messages."""
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"


class ScaleRequest(Strict):
    """POST /scale_elastic_ep: one of ``new_ep_size`` (grow or shrink from the top),
    ``retire_ranks`` (those slots leave) or ``drain_node`` (every slot of that node
    leaves), and an optional ``operation_id`` (a repeat with the same id changes
    nothing); ``keep_processes`` leaves retired ranks' workers up, idle. Strict: ``"3"``
    or ``true`` is not a size."""

    model_config = ConfigDict(extra="forbid", strict=True)

    new_ep_size: int | None = None
    retire_ranks: list[int] | None = Field(None, min_length=1)
    drain_node: int | None = Field(None, ge=0)
    operation_id: str | None = Field(None, min_length=1, max_length=128)
    keep_processes: bool = False

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
