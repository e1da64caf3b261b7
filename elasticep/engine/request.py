"""Typed request/response messages shared by the engine, the workers and the front-end.

These are small frozen dataclasses so they can be pickled over pyzmq between the
HTTP front-end and the worker ranks (mini-sglang style), and reused unchanged by the
single-process engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings, named as in the OpenAI API.

    Attributes:
        max_tokens: number of tokens to generate at most (>= 1).
        temperature: softmax temperature; 0 means greedy (argmax).
        top_p: nucleus mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 disables it.
        seed: seed of the counter-based RNG; None means "derive from request id".
        stop: stop strings; generation ends when the decoded text contains one.
        ignore_eos: keep generating after EOS.

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

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


@dataclass(frozen=True)
class GenerateRequest:
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
class AbortRequest:
    """Ask a rank to drop a request (client disconnected, or stop string hit)."""

    request_id: str


@dataclass(frozen=True)
class TokenOutput:
    """One generated token. ``index`` is its position among the request's outputs.

    ``finish_reason`` is None while the request runs, else "length", "stop" or "abort".
    Consumers deduplicate by (request_id, index), so a redone step never streams a
    token twice.
    """

    request_id: str
    index: int
    token_id: int
    finish_reason: str | None = None
