"""Which logits rows a step needs when some prompt's logprobs are asked for.

A step normally computes the logits of the last token of each sequence that samples. A
prefill chunk of a request with ``prompt_logprobs`` also needs the rows of its prompt
positions: the logits at position p score prompt token p + 1 (position 0 is scored by
nothing, as in vLLM). Only those rows go through the LM head, so a long prompt beside
the request costs no ``[T, V]`` logits.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from elasticep.engine.logprobs import token_logprobs
from elasticep.engine.request import TokenLogprobs
from elasticep.engine.scheduler import ScheduledBatch
from elasticep.engine.sequence import Sequence


@dataclass(frozen=True)
class PromptScoring:
    """The rows of one step's logits when prompts are scored.

    Attributes:
        rows: flat indices into the step's scheduled tokens: first the last token of
            each sampling sequence (batch order), then each scored prompt position.
        num_sampling: how many of ``rows`` are sampling rows.
        spans: per scored chunk, its sequence and the prompt positions whose logits
            are in ``rows`` (in order).
    """

    rows: list[int]
    num_sampling: int
    spans: list[tuple[Sequence, range]]

    @classmethod
    def of(cls, batch: ScheduledBatch) -> PromptScoring | None:
        """The plan for ``batch``, or None when no chunk in it scores its prompt."""
        spans = [(it, range(it.start, min(it.end, len(it.seq.prompt_token_ids) - 1)))
                 for it in batch.items if it.seq.wants_prompt_logprobs]
        spans = [(it, r) for it, r in spans if len(r)]
        if not spans:
            return None
        starts = dict(zip((id(it) for it in batch.items), itertools.accumulate(
            (it.end - it.start for it in batch.items), initial=0), strict=False))
        rows = [starts[id(it)] + it.end - it.start - 1 for it in batch.items if it.samples]
        n = len(rows)
        for it, positions in spans:
            rows += [starts[id(it)] + p - it.start for p in positions]
        return cls(rows, n, [(it.seq, positions) for it, positions in spans])

    def logprobs(self, scored: torch.Tensor) -> dict[str, dict[int, TokenLogprobs]]:
        """request id -> {prompt position: its token's logprobs}.

        Args:
            scored: ``[len(rows) - num_sampling, V]`` the logits of the scored rows.
        """
        out: dict[str, dict[int, TokenLogprobs]] = {}
        at = 0
        for seq, positions in self.spans:
            prompt = seq.prompt_token_ids
            lps = token_logprobs(scored[at:at + len(positions)],
                                 [prompt[p + 1] for p in positions],
                                 [seq.params.prompt_logprobs or 0] * len(positions))
            out[seq.request_id] = {p + 1: lp for p, lp in zip(positions, lps, strict=True)}
            at += len(positions)
        return out
