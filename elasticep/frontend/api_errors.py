"""The error every HTTP API of the front-end answers, in OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``, and the request checks that the
OpenAI and SGLang APIs share, which raise it; and a body that fails its schema as one
such error line (:func:`validation_message`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from elasticep.engine.grammar import check_grammar
from elasticep.engine.request import GrammarSpec

if TYPE_CHECKING:
    from fastapi.exceptions import RequestValidationError


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


_RANGE_ERRORS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")


def _non_finite(value: Any) -> bool:
    """NaN or an infinity, as a JSON number or a string pydantic read as one."""
    try:
        return isinstance(value, float | str) and not math.isfinite(float(value))
    except ValueError:
        return False


def _one_error(err: dict[str, Any], content_type: str) -> tuple[str, str | None]:
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if err.get("type") == "json_invalid":
        return f"Invalid JSON body: {err.get('ctx', {}).get('error', err['msg'])}", None
    if param is None and err.get("type") == "model_attributes_type":
        # FastAPI parses the body as JSON only when the Content-Type says so (curl -d
        # sends a form type): name that, not pydantic's "valid dictionary" wording
        hint = "" if "json" in content_type else (
            f" (it came as Content-Type {content_type or 'none'!r}: send "
            "'Content-Type: application/json')")
        return f"The request body must be a JSON object{hint}", None
    if err.get("type") == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}", param
    value = err.get("input")
    if err.get("type") in _RANGE_ERRORS and _non_finite(value):
        # NaN fails every range check: pydantic would call it out of range
        return f"{param}: Input should be a finite number, got {value}", param
    if err.get("type") == "int_parsing_size":
        # pydantic says "Unable to parse input string" of a JSON number such as 1e300
        return (f"{param}: Input should be an integer of at most 64 bits, got {value!r}",
                param)
    return (f"{param}: {err['msg']}" if param else str(err["msg"])), param


def validation_message(exc: RequestValidationError, content_type: str = "",
                        ) -> tuple[str, str | None]:
    """Every problem of the body in one line, unknown fields first (a misspelt field is
    usually why a required one is missing); ``param`` names the first. ``content_type``:
    the request's header, named when a JSON body was not parsed as JSON."""
    errors = sorted(exc.errors(), key=lambda e: e.get("type") != "extra_forbidden")
    if not errors:
        return "invalid request", None
    parts = [_one_error(e, content_type) for e in errors]
    return "; ".join(dict.fromkeys(m for m, _ in parts)), parts[0][1]
