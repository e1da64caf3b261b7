"""The offline Python API, shaped as vLLM's: ``LLM(...).generate`` and ``.chat``.

    from elasticep import LLM, SamplingParams

    with LLM(model="models/tiny-qwen3-moe", ep_size=2) as llm:
        outs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))
        print(outs[0].outputs[0].text)

An ``LLM`` is a deployment like ``serve``'s (the coordinator process, one worker process
per rank, a front-end without HTTP: :class:`~elasticep.entrypoints.batch_driver.BatchDriver`),
so a rank that dies under :meth:`LLM.generate` costs no output: its requests resume on
the survivors as prompt + generated tokens. Keyword arguments are the deployment flags of
``serve`` and ``generate`` by their field names (``max_ep_size``, ``dtype``,
``load_format``, ``max_total_tokens``, ``heartbeat_timeout``, ...).

Differences from vLLM a user should know: :class:`SamplingParams` is the engine's own
(greedy by default: ``temperature`` 0, ``max_tokens`` 16); ``logprobs`` and
``prompt_logprobs`` return vLLM's per-position ``{token id: logprob}`` dicts.
"""

from __future__ import annotations

import atexit
import threading
import typing
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from tqdm import tqdm

from elasticep.config import DeploymentConfig
from elasticep.deploy import Deployment
from elasticep.engine.request import SamplingParams, TokenLogprobs
from elasticep.entrypoints.batch_driver import BatchDriver
from elasticep.entrypoints.validate import (
    check_model_config,
    check_model_dir,
    check_quantization,
    default_model_dir,
    env_fault,
)
from elasticep.frontend.tokenizer import load_tokenizer
from elasticep.wire.values import ProtocolError, convert, plain

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "GenerationError"]


# the flag spellings (``heartbeat_timeout`` for ``--heartbeat-timeout``) of the fields
# whose names carry a unit
_FLAG_NAMES = {"heartbeat_timeout": "heartbeat_timeout_s",
               "log_stats_interval": "log_stats_interval_s",
               "gc_warning_threshold_secs": "gc_warning_threshold_s",
               "coordinator_timeout": "coordinator_timeout_s"}
# set by the LLM itself, not by a caller
_INTERNAL = {"model", "frontend_request_addr", "frontend_output_addr", "store_addr"}
_FIELD_TYPES = typing.get_type_hints(DeploymentConfig)

Prompt = str | Sequence[int] | Mapping[str, Any]
Message = Mapping[str, Any]


@dataclass
class CompletionOutput:
    """One completion of a prompt (vLLM's ``CompletionOutput``).

    Attributes:
        index: its index among the prompt's completions (0: one completion per prompt).
        text: the generated text, special tokens skipped and stop strings cut.
        token_ids: the generated ids (EOS included where generation stopped on it).
        cumulative_logprob: the sum of the generated tokens' logprobs, when
            ``SamplingParams.logprobs`` asked for them; else None.
        logprobs: per generated token, ``{token id: logprob}`` of the token and its
            ``logprobs`` most likely alternatives (vLLM's shape, raw logprobs before
            penalties and temperature); None unless asked for.
        finish_reason: "stop" (EOS or a stop string) or "length".
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None


@dataclass
class RequestOutput:
    """What one prompt produced (vLLM's ``RequestOutput``).

    Attributes:
        request_id: this LLM's id of the request.
        prompt: the prompt text (the rendered chat for :meth:`LLM.chat`), or None for a
            prompt given as token ids.
        prompt_token_ids: the prompt's ids.
        outputs: its completions (one).
        finished: always True (outputs are returned whole).
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``: None for the first
            prompt token, then ``{token id: logprob}`` per prompt token (vLLM's shape).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    prompt_logprobs: list[dict[int, float] | None] | None = None


def _by_token(lp: TokenLogprobs) -> dict[int, float]:
    """vLLM's per-position form: the token's logprob and its alternatives', by id."""
    return {lp.token_id: lp.logprob, **{t: v for t, v in lp.top if t != lp.token_id}}


class GenerationError(RuntimeError):
    """A request failed on the deployment (e.g. no rank left); names each prompt."""


def deployment_settings(model: str, kwargs: Mapping[str, Any]) -> DeploymentConfig:
    """The :class:`DeploymentConfig` of ``LLM(model, **kwargs)`` (pure apart from the
    config's own checks).

    Args:
        model: the resolved model directory.
        kwargs: deployment fields by name, or by their flag's name
            (``heartbeat_timeout`` for ``heartbeat_timeout_s``).

    Raises:
        TypeError: a keyword that is no deployment setting, or a value of another type
            than the setting's (``True`` for seconds, say).
        ValueError: a value out of range, naming its flag (the config's check).
    """
    known = {f.name for f in fields(DeploymentConfig)} - _INTERNAL
    values: dict[str, Any] = {}
    for key, value in kwargs.items():
        name = _FLAG_NAMES.get(key, key)
        if name not in known:
            raise TypeError(f"LLM() got an unexpected keyword argument {key!r} (deployment "
                            f"settings: {', '.join(sorted(known))})")
        try:  # the type each rank decodes it as: a wrong one killed every rank at start
            convert(plain(value), _FIELD_TYPES[name], key, {})
        except ProtocolError as exc:
            raise TypeError(f"LLM() keyword {exc}") from None
        values[name] = value
    return DeploymentConfig(model=model, **values)


class LLM:
    """A model served by an elastic EP deployment on this machine, for offline batches.

    Args:
        model: HF checkpoint directory (default: the embedded demo model).
        ep_size: ranks to start (worker processes; one GPU each with ``device="cuda"``).
        tokenizer: a directory to load the tokenizer from; default: ``model``'s.
        fault: a fault-injection spec of the launch cohort, as ``generate --fault``
            (e.g. ``"kill:rank=1:step=10"``); default: ``$ELASTICEP_FAULT``.
        log_dir: where worker logs go (``rank<r>.log``); None: a new temporary
            directory, named in one log line (``elasticep.entrypoints.batch_driver``).
        ready_timeout_s: longest wait for every rank to load and be routable (seconds).
        **kwargs: deployment settings by field name (see :func:`deployment_settings`).

    Raises:
        UsageError: a model directory that cannot serve (the message names the fix), or
            a ``log_dir`` that cannot be made or written.
        TypeError / ValueError: a bad deployment setting.
        TimeoutError / RuntimeError: the ranks did not come up.
    """

    def __init__(self, model: str | None = None, *, ep_size: int = 1,
                 tokenizer: str | None = None, fault: str | None = None,
                 log_dir: str | None = None, ready_timeout_s: float = 300.0,
                 **kwargs: Any) -> None:
        model = str(default_model_dir()) if model is None else str(model)
        self.model = model  # as given, as vLLM and serve name it
        config = deployment_settings(check_model_dir(model, kwargs.get(
            "load_format", "auto")), {"ep_size": ep_size, **kwargs})
        check_quantization(config.model, config.quantization)  # before any rank starts
        check_model_config(config.model)
        self.tokenizer = load_tokenizer(tokenizer or config.model)
        self._lock = threading.Lock()  # one batch at a time: the driver owns one loop
        self._driver: BatchDriver | None = BatchDriver.launch(
            config, self._decode, fault=fault if fault is not None else env_fault(),
            log_dir=log_dir, ready_timeout_s=ready_timeout_s)
        self._requests = 0
        # a script that never calls shutdown() must not leave ranks behind; weakly, so
        # the registry does not keep a dropped LLM alive
        self._atexit = _shutdown_at_exit(self)
        atexit.register(self._atexit)

    @property
    def config(self) -> DeploymentConfig:
        """The deployment's settings (its model is the resolved directory)."""
        return self._running().deployment.config

    @property
    def deployment(self) -> Deployment:
        """The running deployment (its ranks, e.g. to kill or relaunch one)."""
        return self._running().deployment

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _running(self) -> BatchDriver:
        if self._driver is None:
            raise RuntimeError("this LLM is shut down")
        return self._driver

    # ---- generation ------------------------------------------------------------------
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool = True, timeout_s: float = 600.0) -> list[RequestOutput]:
        """Complete every prompt; outputs in input order.

        Args:
            prompts: one prompt or a list: text, a list of token ids, or a dict with
                ``"prompt"`` or ``"prompt_token_ids"`` (vLLM's ``TextPrompt`` /
                ``TokensPrompt``).
            sampling_params: shared by all prompts, or one per prompt; None: greedy,
                16 tokens.
            use_tqdm: show a progress bar of finished prompts (stderr).
            timeout_s: bound of the whole batch (seconds).

        Raises:
            ValueError: an empty or malformed prompt, bad sampling params, or a list of
                params whose length differs from the prompts'.
            GenerationError: a request failed on the deployment.
            TimeoutError: the batch did not finish in time.
        """
        texts, ids = self._encode_all(_as_list(prompts))
        return self._run(texts, ids, sampling_params, use_tqdm, timeout_s)

    def chat(self, messages: Sequence[Message] | Sequence[Sequence[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             *, use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: str | None = None,
             chat_template_kwargs: Mapping[str, Any] | None = None,
             tools: Sequence[Mapping[str, Any]] | None = None,
             timeout_s: float = 600.0) -> list[RequestOutput]:
        """Answer one conversation or a list of them, with the model's chat template.

        Args:
            messages: ``[{"role": ..., "content": ...}, ...]``, or a list of such lists.
            sampling_params: as :meth:`generate`.
            use_tqdm: show a progress bar.
            add_generation_prompt: end the rendered prompt with the assistant's header.
            chat_template: a Jinja template to use instead of the tokenizer's own.
            chat_template_kwargs: extra template variables (e.g. ``enable_thinking``).
            tools: tool definitions (OpenAI's shape) handed to the template.
            timeout_s: bound of the whole batch (seconds).

        Raises:
            ValueError: the model has no chat template, or it failed on the messages.
            GenerationError / TimeoutError: as :meth:`generate`.
        """
        if not (chat_template or getattr(self.tokenizer, "chat_template", None)):
            raise ValueError(f"the model {self.model} has no chat template; use generate()")
        conversations = ([messages] if messages and isinstance(messages[0], Mapping)
                         else list(messages))
        rendered = []
        for i, conv in enumerate(conversations):
            try:
                rendered.append(self.tokenizer.apply_chat_template(
                    [dict(m) for m in conv], tokenize=False,
                    add_generation_prompt=add_generation_prompt, chat_template=chat_template,
                    tools=list(tools) if tools else None, **dict(chat_template_kwargs or {})))
            except Exception as exc:  # noqa: BLE001 - jinja raises many types on bad input
                raise ValueError(f"conversation {i}: the chat template failed: {exc}") from exc
        ids = [self.tokenizer.encode(text, add_special_tokens=False) for text in rendered]
        return self._run(rendered, ids, sampling_params, use_tqdm, timeout_s)

    def _encode_all(self, prompts: list[Prompt]) -> tuple[list[str | None], list[list[int]]]:
        texts: list[str | None] = []
        ids: list[list[int]] = []
        for i, p in enumerate(prompts):
            if isinstance(p, Mapping):
                p = p["prompt_token_ids"] if "prompt_token_ids" in p else p.get("prompt")
            if isinstance(p, str):
                texts.append(p)
                ids.append(list(self.tokenizer(p).input_ids))
            elif isinstance(p, Sequence) and all(isinstance(t, int) for t in p):
                texts.append(None)
                ids.append(list(p))
            else:
                raise ValueError(f"prompt {i}: expected text, token ids or a dict with "
                                 f'"prompt" / "prompt_token_ids", got {type(p).__name__}')
            if not ids[-1]:
                raise ValueError(f"prompt {i} is empty")
        return texts, ids

    def _run(self, texts: list[str | None], ids: list[list[int]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None,
             use_tqdm: bool, timeout_s: float) -> list[RequestOutput]:
        params = SamplingParams() if sampling_params is None else sampling_params
        for p in [params] if isinstance(params, SamplingParams) else params:
            p.validate()
        driver = self._running()
        with self._lock, tqdm(total=len(ids), desc="Processed prompts", unit="prompt",
                              disable=not use_tqdm, dynamic_ncols=True) as bar:
            def on_event(_: int, event: Any) -> None:
                if event.finish_reason is not None:
                    bar.update(1)

            done = driver.generate(ids, params, timeout_s=timeout_s, on_event=on_event)
        failed = [f"prompt {i}: {c.error}" for i, c in enumerate(done) if c.error]
        if failed:
            raise GenerationError("; ".join(failed))
        outs = []
        for text, prompt_ids, c in zip(texts, ids, done, strict=True):
            self._requests += 1
            wants = (params if isinstance(params, SamplingParams) else params[len(outs)])
            lps = [_by_token(lp) for lp in c.logprobs] if wants.logprobs is not None else None
            prompt_lps = ([None, *(_by_token(lp) for lp in c.prompt_logprobs)]
                          if c.prompt_logprobs is not None else None)
            outs.append(RequestOutput(str(self._requests), text, prompt_ids, [CompletionOutput(
                0, c.text, list(c.token_ids),
                cumulative_logprob=(sum(lp.logprob for lp in c.logprobs)
                                    if lps is not None else None),
                logprobs=lps, finish_reason=c.finish_reason)], prompt_logprobs=prompt_lps))
        return outs

    # ---- lifecycle -------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the front-end, the ranks (by pid) and the coordinator; idempotent."""
        driver, self._driver = self._driver, None
        if driver is not None:
            atexit.unregister(self._atexit)
            driver.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _shutdown_at_exit(llm: LLM) -> Callable[[], None]:
    """An atexit hook that shuts ``llm`` down if it still exists (held weakly)."""
    ref = weakref.ref(llm)

    def stop() -> None:
        target = ref()
        if target is not None:
            target.shutdown()

    return stop


def _as_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt as a list of one: text, a dict, or a flat list of ids."""
    if isinstance(prompts, str | Mapping):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    return list(prompts)
