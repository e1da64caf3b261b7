"""The sampling fields that OpenAI's request bodies and SGLang's ``sampling_params`` name
alike, and the steps both take to turn a request into the engine's
:class:`~elasticep.engine.request.SamplingParams`.

The shared fields are vLLM's and SGLang's sampling extensions, with the same names,
defaults and bounds in both APIs. Fields whose default or bound differs between the two
(``temperature``, ``top_k``, ``n``, the token budgets, the seed) stay in each API's own
model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from elasticep.engine.request import SamplingParamError, SamplingParams
from elasticep.frontend.api_errors import OpenAIError
from elasticep.models.config import SamplingDefaults


class Strict(BaseModel):
    """A request model that rejects unknown fields (a 400 naming the field)."""

    model_config = ConfigDict(extra="forbid")


class SharedSamplingFields(Strict):
    """The sampling fields both APIs take, under the same names."""

    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # structured output (with OpenAI's response_format or SGLang's json_schema)
    regex: str | None = None
    ebnf: str | None = None

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def logit_bias_pairs(self, prefix: str = "") -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as ``(token id, bias)`` pairs.

        Args:
            prefix: where the model sits in the request body (``"sampling_params."``
                for SGLang's), for the error's field name.

        Raises:
            OpenAIError: 400 naming ``logit_bias`` for a key that is not a token id.
        """
        try:
            return tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items())
        except ValueError:
            raise OpenAIError(400, f"{prefix}logit_bias keys must be token ids (integers as "
                              "strings)", param=f"{prefix}logit_bias") from None

    def model_default(self, name: str, defaults: SamplingDefaults) -> Any:
        """Field ``name``'s value: the request's if it sent one, else the model's
        ``generation_config.json`` value if it has one, else the field's default."""
        model_value = getattr(defaults, name)
        if name in self.model_fields_set or model_value is None:
            return getattr(self, name)
        return model_value

    def shared_params(self, defaults: SamplingDefaults, prefix: str = "") -> dict[str, Any]:
        """The engine params these fields give, as keyword arguments of
        :class:`SamplingParams` (``top_p`` falls back on the model's default).

        Raises:
            OpenAIError: 400 from :meth:`logit_bias_pairs`.
        """
        return dict(
            top_p=self.model_default("top_p", defaults),
            stop=self.stop_strings(), stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos, min_p=self.min_p,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=self.logit_bias_pairs(prefix),
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens)


def validated(params: SamplingParams, param_of: Callable[[str], str]) -> SamplingParams:
    """``params`` once :meth:`SamplingParams.validate` accepts them.

    Args:
        param_of: the request field an engine field came from (for the error).

    Raises:
        OpenAIError: 400 naming that request field, for a value out of the engine's range.
    """
    try:
        params.validate()
    except SamplingParamError as exc:
        raise OpenAIError(400, str(exc), param=param_of(exc.param)) from exc
    return params
