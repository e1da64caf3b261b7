"""Continuous-batching scheduler over a paged KV cache (pure bookkeeping, no tensors).

Every step, running sequences each get one decode token and waiting sequences are
admitted (FIFO) while KV blocks, the sequence limit and the token budget allow. When a
running sequence cannot grow, the newest running sequence is preempted: its blocks are
freed and it goes back to the front of the queue, to be recomputed from prompt +
generated tokens. A full cache therefore delays requests and never fails them.

With ``chunked_prefill_size`` set (SGLang's ``--chunked-prefill-size``), a step's
prefill tokens are capped at that size: a long prompt is computed over several steps,
``[start, end)`` a chunk at a time, while every running decode still gets its token
each step. A sequence whose prefill is not finished samples nothing
(:attr:`ScheduledSeq.samples`) and holds blocks only for the chunks computed so far.
Chunks go to partly prefilled sequences first (oldest first), then to admissions. The
token arithmetic is :mod:`elasticep.engine.admission`'s pure policy; this class adds the
KV blocks and preemption.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

from elasticep.engine.admission import StepBudget, take_chunks
from elasticep.engine.kv_cache import BlockManager
from elasticep.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's share of a step: compute tokens ``[start, end)`` of it."""

    seq: Sequence
    start: int
    end: int

    @property
    def samples(self) -> bool:
        """True when this step draws the sequence's next token: its last known token is
        computed (a decode, or the last chunk of a prefill). Valid from schedule to
        commit, which is what appends the token."""
        return self.end == self.seq.num_tokens


@dataclass(frozen=True)
class ScheduledBatch:
    """The work of one step; re-executable until committed (a redo after a failure)."""

    items: tuple[ScheduledSeq, ...]

    @property
    def num_tokens(self) -> int:
        """Tokens the forward pass processes."""
        return sum(it.end - it.start for it in self.items)

    @property
    def one_token_each(self) -> bool:
        """True when the step computes one token of each of its (one or more) sequences:
        a decode step. A step with a prefill chunk runs eagerly (its forward keeps the
        host busy until it is nearly done) unless its tokens fit a captured graph's
        bucket (:mod:`elasticep.engine.model_runner`: one row a token)."""
        return bool(self.items) and all(it.end - it.start == 1 for it in self.items)

    def __len__(self) -> int:
        return len(self.items)


class Scheduler:
    """Decides which sequences run each step.

    Args:
        blocks: the KV block manager.
        max_num_seqs: most sequences in one step.
        max_batch_tokens: token budget per step for admitting prefills, decodes counted
            (unchunked, the first admitted prefill may exceed it, so long prompts are
            never starved).
        chunked_prefill_size: most prefill tokens per step, or None to compute every
            prompt in one step.

    Raises:
        ValueError: ``chunked_prefill_size`` is not None and below 1, or
            ``max_batch_tokens`` below 1 (:class:`~elasticep.engine.admission.StepBudget`).
    """

    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_batch_tokens: int,
                 chunked_prefill_size: int | None = None) -> None:
        self.budget = StepBudget(max_batch_tokens, chunked_prefill_size)
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max_batch_tokens
        self.chunked_prefill_size = chunked_prefill_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a new or resumed sequence."""
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        """True while any sequence waits or runs."""
        return bool(self.waiting or self.running)

    def remove(self, request_id: str) -> Sequence | None:
        """Drop a sequence wherever it is and free its blocks; None if unknown."""
        for seq in list(self.waiting) + self.running:
            if seq.request_id == request_id:
                self.finish(seq, "abort")
                return seq
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark ``seq`` finished, free its blocks and take it out of the queues."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.blocks.free(seq.block_table)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq.block_table)
        seq.num_cached_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> ScheduledBatch:
        """Plan one step by :mod:`elasticep.engine.admission`'s policy: every running
        decode, then prefill chunks within the step's budget (partly prefilled prompts
        first, then admissions in arrival order), preempting the newest running
        sequence when KV blocks run short."""
        budget = self.budget
        chunked = budget.chunked_prefill_size is not None
        # Prefill tokens this step may still take. Counting the decodes before any
        # preemption only makes it smaller than it could be, never too large.
        prefill = budget.prefill_tokens(sum(1 for s in self.running if s.num_new_tokens == 1))
        items: list[ScheduledSeq] = []
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = seq.num_new_tokens  # 1 for a decode; more only for a partly prefilled one
            is_chunk = chunked and n > 1
            if is_chunk:
                n = min(n, prefill)
                if n < 1:
                    continue  # no prefill budget left this step: it keeps its blocks
            end = seq.num_cached_tokens + n
            while not self.blocks.can_grow(seq.block_table, end):
                victim = max(self.running, key=lambda s: s.arrival)
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                self.blocks.grow(seq.block_table, end)
                items.append(ScheduledSeq(seq, seq.num_cached_tokens, end))
                if is_chunk:
                    prefill -= n
        if not chunked:  # whole prompts: what the decodes left (after any preemption)
            prefill = budget.max_num_batched_tokens - sum(it.end - it.start for it in items)
        free = self.max_num_seqs - len(self.running)
        needs = [seq.num_new_tokens for seq in itertools.islice(self.waiting, max(0, free))]
        for need in take_chunks(needs, prefill, chunked, not items):
            seq = self.waiting[0]
            start = seq.num_cached_tokens  # 0: waiting sequences hold no blocks
            if not self.blocks.can_grow(seq.block_table, start + need):
                break
            self.waiting.popleft()
            self.blocks.grow(seq.block_table, start + need)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            items.append(ScheduledSeq(seq, start, start + need))
        return ScheduledBatch(tuple(items))
