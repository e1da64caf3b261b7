"""The error every HTTP API of the front-end answers, in OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``, and the request checks that the
OpenAI and SGLang APIs share, which raise it."""

from __future__ import annotations

from typing import Any

from elasticep.engine.grammar import check_grammar
from elasticep.engine.request import GrammarSpec


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


def checked_grammar(spec: GrammarSpec, param: str) -> GrammarSpec:
    """``spec`` once it parses (the ranks would refuse it later).

    Raises:
        OpenAIError: 400 naming ``param`` with the grammar library's reason.
    """
    try:
        check_grammar(spec)
    except ValueError as exc:
        raise OpenAIError(400, f"{param}: {exc}", param=param) from None
    return spec


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
