"""How one step's tokens are shared between decodes and prefills (pure).

The policy is mixed chunked prefill, as SGLang's ``--enable-mixed-chunk`` and vLLM's
chunked-prefill scheduling run it:

1. Every running decode gets its token, every step: a new request never pauses the
   streams already running.
2. Prefill tokens fill what is left of the step's budget, ``--max-num-batched-tokens``
   (vLLM's name; decodes included), and at most ``--chunked-prefill-size`` (SGLang's)
   of them: partly prefilled prompts first (oldest first), then new requests in arrival
   order, each taking ``min(its remaining prompt, the budget left)``. A prompt longer
   than that continues in the next steps.

So a request that arrives while the budget has room is computed in the very next step
(it waits for no step), and a step that carries prefill holds at most
``max(budget, decodes)`` tokens, so the inter-token latency of the running decodes stays
bounded by the cost of one such step, whatever arrives. The alternatives were rejected:
prefill-only steps (SGLang's default without the flag) stall every decode for a whole
prefill, and admitting only when the batch drains makes a new request wait for the
longest running one.

Without chunking (``chunked_prefill_size`` None, the CPU default) a prompt is computed
in one step: new requests are admitted while their whole prompts fit the budget, and a
prompt larger than the budget is admitted alone, into a step with nothing else, so it
is never starved.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StepBudget:
    """A step's token limits.

    Attributes:
        max_num_batched_tokens: tokens one step forwards, decodes included (vLLM's
            ``--max-num-batched-tokens``); decodes alone may exceed it, prefill never
            makes a step exceed it.
        chunked_prefill_size: most prefill tokens in one step (SGLang's
            ``--chunked-prefill-size``), None: whole prompts (see the module doc).

    Raises:
        ValueError: a limit below 1.
    """

    max_num_batched_tokens: int
    chunked_prefill_size: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < 1:
            raise ValueError(f"chunked_prefill_size must be >= 1 or None, got {self.chunked_prefill_size}")

    def prefill_tokens(self, num_decodes: int) -> int:
        """The prefill tokens a step with ``num_decodes`` decodes may carry (>= 0)."""
        left = max(0, self.max_num_batched_tokens - num_decodes)
        return left if self.chunked_prefill_size is None else min(left, self.chunked_prefill_size)


@dataclass(frozen=True)
class StepPlan:
    """The tokens of one step: ``partial[i]`` for the i-th partly prefilled prompt,
    ``admitted[j]`` for the j-th waiting request (the first ``len(admitted)`` are
    admitted), beside ``decodes`` decodes."""

    decodes: int
    partial: tuple[int, ...]
    admitted: tuple[int, ...]

    @property
    def prefill(self) -> int:
        """Prefill tokens of the step."""
        return sum(self.partial) + sum(self.admitted)

    @property
    def num_tokens(self) -> int:
        """Tokens the step forwards."""
        return self.decodes + self.prefill


def take_chunks(needs: Sequence[int], budget: int, chunked: bool, step_empty: bool,
                ) -> list[int]:
    """Tokens given to each of ``needs`` (remaining prompt tokens, in priority order) out
    of ``budget``; stops at the first one that gets none (pure).

    Args:
        needs: tokens each sequence still has to prefill (>= 1 each).
        budget: prefill tokens left this step.
        chunked: a sequence may take part of its prompt (``min(need, left)``); else
            only whole prompts fit.
        step_empty: unchunked only: the step has nothing else yet, so the first prompt is
            taken whole even above ``budget`` (a long prompt is never starved).

    Returns:
        One entry per taken sequence (a prefix of ``needs``), each >= 1.
    """
    out: list[int] = []
    left = budget
    for need in needs:
        if chunked:
            n = min(need, left)
            if n < 1:
                break
        elif need <= left or (step_empty and not out):
            n = need
        else:
            break
        out.append(n)
        left = max(0, left - n)
    return out


def plan_step(num_decodes: int, partial: Sequence[int], waiting: Sequence[int],
              free_seqs: int, budget: StepBudget) -> StepPlan:
    """One step's plan (pure; KV blocks aside, which the scheduler checks as it goes).

    Args:
        num_decodes: running sequences that decode one token.
        partial: remaining prompt tokens of partly prefilled running sequences, oldest
            first (chunked only).
        waiting: prompt tokens of the waiting requests, in arrival order.
        free_seqs: sequences the step may still add (``max_num_seqs`` - running).
        budget: the step's limits.

    Returns:
        The plan; its ``num_tokens <= max(budget.max_num_batched_tokens, num_decodes)``
        unless an unchunked prompt above the budget runs alone.
    """
    chunked = budget.chunked_prefill_size is not None
    left = budget.prefill_tokens(num_decodes)
    got = take_chunks(partial, left, True, False) if chunked else []
    left -= sum(got)
    admitted = take_chunks(list(waiting[:max(0, free_seqs)]), left, chunked,
                           num_decodes == 0 and not got)
    return StepPlan(num_decodes, tuple(got), tuple(admitted))
