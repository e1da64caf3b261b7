"""Mutable per-request state inside one engine: tokens, KV blocks, status."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from elasticep.engine.request import GenerateRequest, SamplingParams, TokenLogprobs


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life: queued, in the running batch, or done."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """One request's live state.

    Attributes:
        request_id: the request's id (also keys the sampler RNG).
        prompt_token_ids: prompt tokens.
        output_token_ids: generated tokens so far (a resumed request starts non-empty).
        params: sampling settings.
        arrival: admission order; higher = newer (preempted first).
        block_table: KV-cache block ids, in order.
        num_cached_tokens: how many leading tokens have their K/V in the cache.
        num_resumed_outputs: outputs that came with the request (not re-published).
        prompt_logprobs: prompt position -> the logprobs of the prompt token there,
            gathered over prefill chunks when ``params.prompt_logprobs`` is set (a
            recomputed chunk rewrites its positions).
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    arrival: int
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_resumed_outputs: int = 0
    finish_reason: str | None = None
    prompt_logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """True while the prompt's logprobs are still to be published (with the first
        output): asked for, and no output yet (a resumed request's went out with its
        first output on its first rank)."""
        return self.params.prompt_logprobs is not None and not self.output_token_ids

    @classmethod
    def from_request(cls, req: GenerateRequest, arrival: int) -> Sequence:
        """Build the state of a new (or resumed) request."""
        return cls(
            request_id=req.request_id,
            prompt_token_ids=list(req.prompt_token_ids),
            output_token_ids=list(req.output_token_ids),
            params=req.params,
            arrival=arrival,
            num_resumed_outputs=len(req.output_token_ids),
        )

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_at(self, position: int) -> int:
        """The token at ``position`` of prompt + generated, without building that list."""
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by generated tokens."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_new_tokens(self) -> int:
        """Tokens whose K/V the next forward must compute (1 when decoding)."""
        return self.num_tokens - self.num_cached_tokens
