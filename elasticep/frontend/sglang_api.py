"""SGLang's native API on the front-end: ``POST /generate``, ``GET /get_server_info`` and
``GET /get_model_info``, in SGLang's shapes, so SGLang's clients (``bench_serving
--backend sglang``, its ``RuntimeEndpoint``) work against ``serve`` unchanged.

``/generate`` takes one prompt (``text`` or ``input_ids``) and ``sampling_params``
(``max_new_tokens``, default 128 as SGLang's; ``temperature``, ``top_p``, ``top_k`` (-1
disables), ``min_p``, ``min_new_tokens``, ``frequency_penalty``, ``presence_penalty``,
``repetition_penalty``, ``stop``, ``stop_token_ids``, ``ignore_eos``, ``sampling_seed``,
``logit_bias``, ``skip_special_tokens``, ``spaces_between_special_tokens``, and one
structured-output constraint of ``json_schema``, ``regex``, ``ebnf``). Fields
SGLang has but we do not implement accept only their default value; anything else is a
400 naming the field. ``return_logprob`` adds ``meta_info.output_token_logprobs``
(``[logprob, token id, text or None]`` per token) and, with ``top_logprobs_num``,
``output_top_logprobs``; ``logprob_start_len`` >= 0 adds the prompt's from that
position (``input_token_logprobs``, ``input_top_logprobs``; the first prompt token's
logprob is None); ``return_text_in_logprobs`` fills in the texts.
The answer is ``{"text", "meta_info": {"id", "finish_reason", "prompt_tokens",
"completion_tokens", "cached_tokens", "e2e_latency"}}``; streamed (``"stream": true``),
one such object per token as ``data: {...}`` with the text so far (SGLang's default,
non-incremental output), then ``data: [DONE]``. ``finish_reason`` is None while running,
else ``{"type": "length", "length": N}``, ``{"type": "stop", "matched": None}`` (which
stop condition matched is not reported by the ranks) or ``{"type": "abort", "message"}``.
Errors are OpenAI error JSON, as on the rest of the server.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from elasticep import __version__
from elasticep.engine.request import GrammarSpec, SamplingParams, TokenLogprobs
from elasticep.frontend.api_errors import OpenAIError, checked_grammar, resolve_max_tokens
from elasticep.frontend.logprobs_format import TokenText, sglang_logprobs
from elasticep.frontend.openai_responses import new_id
from elasticep.frontend.openai_serving import OpenAIServing
from elasticep.frontend.request_tracker import RequestEvent
from elasticep.frontend.sampling_fields import SharedSamplingFields, Strict, validated
from elasticep.membership.transitions import SlotState
from elasticep.models.config import SamplingDefaults

if TYPE_CHECKING:  # http_server imports this module
    from elasticep.frontend.http_server import ServerConfig


def _reject_non_defaults(model: Strict, prefix: str = "") -> None:
    """Raises:
        OpenAIError: 400 naming the first of ``model.UNSUPPORTED`` whose value is not
            its field's default (the only value we implement).
    """
    for name in model.UNSUPPORTED:
        value, default = getattr(model, name), type(model).model_fields[name].default
        if value != default:
            raise OpenAIError(400, f"{prefix}{name}={value!r} is not supported (only "
                              f"{default!r})", param=f"{prefix}{name}")


class SglangSamplingParams(SharedSamplingFields):
    """``sampling_params`` of ``/generate``, named as SGLang's."""

    max_new_tokens: int | None = Field(128, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_k: int = Field(-1, ge=-1)
    sampling_seed: int | None = None
    min_new_tokens: int = 0
    n: int = 1
    no_stop_trim: bool = False
    json_schema: str | None = None

    # SGLang's fields we do not implement: only their default value is accepted
    UNSUPPORTED: ClassVar[tuple[str, ...]] = (
        "n", "no_stop_trim")


    def grammar_spec(self) -> GrammarSpec | None:
        """SGLang's structured output: one of ``json_schema`` (JSON text), ``regex``,
        ``ebnf``; None: free text.

        Raises:
            OpenAIError: 400 naming the field: two at once, or one that does not parse.
        """
        asked = [n for n in ("json_schema", "regex", "ebnf") if getattr(self, n) is not None]
        if len(asked) > 1:
            raise OpenAIError(400, f"send one of json_schema, regex and ebnf, not "
                              f"{' and '.join(asked)}", param=f"sampling_params.{asked[1]}")
        if not asked:
            return None
        return checked_grammar(GrammarSpec(asked[0], getattr(self, asked[0])),
                               f"sampling_params.{asked[0]}")


class SglangGenerateRequest(Strict):
    """``POST /generate``: one prompt, as ``text`` or ``input_ids``."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SglangSamplingParams = Field(default_factory=SglangSamplingParams)
    stream: bool = False
    rid: str | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    return_routed_experts: bool = False
    lora_path: str | None = None
    image_data: Any = None

    UNSUPPORTED: ClassVar[tuple[str, ...]] = ("return_routed_experts", "lora_path", "image_data")

    def prompt(self) -> tuple[str | list[int], str]:
        """The one prompt and the field it came in (unwrapped from a batch of one).

        Raises:
            OpenAIError: 400 for neither or both fields, or a batch of several.
        """
        if (self.text is None) == (self.input_ids is None):
            raise OpenAIError(400, "send exactly one of text and input_ids", param="text")
        param = "text" if self.text is not None else "input_ids"
        prompt: Any = self.text if self.text is not None else self.input_ids
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise OpenAIError(400, "only one prompt per request is supported",
                                  param=param)
            prompt = prompt[0]
        return prompt, param

    def to_sampling_params(self, prompt_len: int, max_model_len: int,
                           defaults: SamplingDefaults) -> SamplingParams:
        """Engine sampling params; the model's generation_config fills unsent fields.

        Raises:
            OpenAIError: 400 for an unsupported value or a request that does not fit.
        """
        _reject_non_defaults(self)
        sp = self.sampling_params
        _reject_non_defaults(sp, "sampling_params.")
        shared = sp.shared_params(defaults, "sampling_params.")
        if self.logprob_start_len >= prompt_len:
            raise OpenAIError(400, f"logprob_start_len must be below the prompt's {prompt_len} "
                              "tokens", param="logprob_start_len")
        top = self.top_logprobs_num if self.return_logprob else None
        return validated(SamplingParams(
            max_tokens=resolve_max_tokens(prompt_len, sp.max_new_tokens, max_model_len,
                                          "sampling_params.max_new_tokens"),
            temperature=sp.model_default("temperature", defaults),
            top_k=max(sp.model_default("top_k", defaults), 0),
            seed=sp.sampling_seed, min_tokens=sp.min_new_tokens, **shared, logprobs=top,
            prompt_logprobs=top if top is not None and self.logprob_start_len >= 0 else None,
            grammar=sp.grammar_spec(),
        ), lambda param: {"logprobs": "top_logprobs_num", "prompt_logprobs": "top_logprobs_num",
                          "min_tokens": "sampling_params.min_new_tokens"}.get(
            param, f"sampling_params.{param}"))

    def logprobs_meta(self, token_text: TokenText, output: Sequence[TokenLogprobs],
                      prompt_ids: Sequence[int],
                      prompt: Sequence[TokenLogprobs] | None) -> dict[str, Any]:
        """The logprob fields of ``meta_info`` (none unless ``return_logprob``)."""
        if not self.return_logprob:
            return {}
        text = token_text if self.return_text_in_logprobs else None
        lps, tops = sglang_logprobs(text, output)
        meta: dict[str, Any] = {"output_token_logprobs": lps, "output_top_logprobs": tops}
        if self.logprob_start_len >= 0:
            start = self.logprob_start_len
            # the first prompt token has no logprob (nothing predicts it)
            first = [TokenLogprobs(prompt_ids[0], math.nan)] if start == 0 else []
            ins, in_tops = sglang_logprobs(text, first + list(prompt or ())[max(start - 1, 0):])
            if start == 0:
                ins[0][0], in_tops[0] = None, None
            meta |= {"input_token_logprobs": ins, "input_top_logprobs": in_tops}
        return meta


def finish_reason(reason: str | None, num_tokens: int, error: str | None = None,
                  ) -> dict[str, Any] | None:
    """SGLang's ``meta_info.finish_reason`` for one of ours (pure)."""
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": num_tokens}
    if reason == "stop":
        return {"type": "stop", "matched": None}
    return {"type": "abort", "message": error or "aborted"}


def add_sglang_routes(app: FastAPI, serving: OpenAIServing, config: ServerConfig) -> None:
    """Register ``/generate``, ``/get_server_info`` and ``/get_model_info`` on ``app``."""

    @app.post("/generate")
    async def generate(req: SglangGenerateRequest, raw: Request) -> Response:
        prompt, param = req.prompt()
        ids = await serving.encode_prompt(prompt, param)
        params = serving.check_token_ids(req.to_sampling_params(
            len(ids), serving.max_model_len, serving.sampling_defaults), "sampling_params.")
        rid = req.rid or new_id("gen")
        start = time.perf_counter()
        stream = serving.submit(rid, ids, params)

        def meta(num_tokens: int, reason: str | None, lps: Sequence[TokenLogprobs],
                 prompt_lps: Sequence[TokenLogprobs] | None) -> dict[str, Any]:
            return {"id": rid, "finish_reason": finish_reason(reason, num_tokens),
                    "prompt_tokens": len(ids), "completion_tokens": num_tokens,
                    "cached_tokens": 0, "e2e_latency": round(time.perf_counter() - start, 6),
                    **req.logprobs_meta(serving.token_text, lps, ids, prompt_lps)}

        if req.stream:
            # SGLang's default stream: each chunk has everything so far
            parts: list[str] = []
            lps: list[TokenLogprobs] = []
            prompt_lps: list[tuple[TokenLogprobs, ...] | None] = [None]

            def render(event: RequestEvent) -> str:
                parts.append(event.text)
                lps.extend(event.logprobs)
                if event.prompt_logprobs is not None:
                    prompt_lps[0] = event.prompt_logprobs
                return json.dumps({"text": "".join(parts), "meta_info": meta(
                    event.num_generated, event.finish_reason, lps, prompt_lps[0])})

            return serving.sse(stream, "generate", render)
        result = await serving.collect(stream, raw, "generate")
        return JSONResponse({"text": result.text, "meta_info": meta(
            result.num_tokens, result.finish_reason, result.logprobs, result.prompt_logprobs)})

    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        return {"model_path": config.model_path, "tokenizer_path": config.model_path,
                "served_model_name": config.model_name, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": "default",
                "has_image_understanding": False, "has_audio_understanding": False}

    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        status = serving.frontend.status()
        return {"model_path": config.model_path, "tokenizer_path": config.model_path,
                "served_model_name": config.model_name, "context_length": config.max_model_len,
                "tp_size": 1, "dp_size": 1,
                "ep_size": status.ep_size, "max_ep_size": status.max_ep_size,
                "epoch": status.epoch, "version": f"elasticep {__version__}",
                # SGLang lists one state per scheduler here, and its clients read entry 0
                # (older bench_serving without checking that there is one): ours are
                # the ranks' (/elastic_ep_status's entries: state, running requests,
                # KV tokens, max running requests), those not in a free slot
                "internal_states": [r.to_dict() for r in status.ranks
                                    if r.state != SlotState.FREE]}
