"""A rank's periodic throughput line: steps, generated tokens, and decode graph use.

The decode part counts the interval's decode steps (every sequence of the rank's batch
decodes one token) that replayed a captured graph and those that ran eagerly, and the
captures (how many times the buckets were captured, start-up included), so a failover
run shows its replay share and its re-captures as numbers (``bench/failover.py`` reads
them from this line, which reads::

    rank 0 epoch 1: 90 steps in 1.0 s (11.10 ms/step), 700.2 generated tokens/s,
    7.8 tokens/step; decode CUDA graph replays: 88 of 89 decode steps (1 eager);
    prefill steps replayed as rows: 1; graph captures: 1 since start (+0); ms/step in
    header 0.05, execute 10.80, commit 0.04, publish 0.12

on one line; a rank without graphs has ``no CUDA graphs`` there, and the timed parts
of a step (:meth:`StepRateLog.timed`, wall seconds a step spent in each, averaged over
the interval's steps) come last when the loop times any). Both worker loops (:mod:`elasticep.elastic.serve_loop`,
:mod:`elasticep.elastic.step_loop`) feed it once per committed step. Every ``interval_s`` with at least one step it logs
one INFO line, so a slow rank, or one that runs eagerly when it should replay its
decode CUDA graphs (after a placement change, say), shows in its log.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

logger = logging.getLogger(__name__)


class DecodeCounters(Protocol):
    """Running counts of an engine's decode steps
    (:class:`elasticep.engine.model_runner.ModelRunner` has them).

    Attributes:
        decode_replays: decode steps replayed from a captured graph since start.
        decode_eager: decode steps run eagerly since start.
        prefill_replays: steps with prefill tokens replayed from a decode graph, one
            row a token, since start.
        graph_captures: complete decode-graph captures since start; None: no graphs.
    """

    decode_replays: int
    decode_eager: int
    prefill_replays: int

    @property
    def graph_captures(self) -> int | None: ...


class StepRateLog:
    """Counts steps and generated tokens; logs their rates once per interval.

    Args:
        rank: for the line.
        decode: the engine's decode counters; None for an engine without them (the
            line then leaves the decode part out).
        interval_s: seconds between lines; 0 or less disables the log.
        clock: monotonic seconds (tests pass a fake).
    """

    def __init__(self, rank: int, decode: DecodeCounters | None, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rank, self.decode, self.interval_s, self.clock = rank, decode, interval_s, clock
        self._reset(self.clock())

    def _reset(self, now: float) -> None:
        self._t0, self._steps, self._tokens = now, 0, 0
        self._parts: dict[str, float] = {}
        d = self.decode
        if d is None:
            self._replays0 = self._eager0 = self._prefill0 = self._captures0 = 0
        else:
            self._replays0, self._eager0 = d.decode_replays, d.decode_eager
            self._prefill0 = d.prefill_replays
            self._captures0 = d.graph_captures or 0

    def timed(self, part: str, seconds: float) -> None:
        """Add ``seconds`` (wall time) to the step part ``part`` of this interval; parts
        are listed in the line in the order first timed."""
        self._parts[part] = self._parts.get(part, 0.0) + seconds

    def step(self, tokens: int, epoch: int) -> str | None:
        """Count one committed step that generated ``tokens`` tokens.

        Returns:
            The line logged, when this step closed an interval; else None.
        """
        self._steps += 1
        self._tokens += tokens
        now = self.clock()
        dt = now - self._t0
        if self.interval_s <= 0 or dt < self.interval_s:
            return None
        line = (f"rank {self.rank} epoch {epoch}: {self._steps} steps in {dt:.1f} s "
                f"({1000 * dt / self._steps:.2f} ms/step), {self._tokens / dt:.1f} generated "
                f"tokens/s, {self._tokens / self._steps:.1f} tokens/step")
        d = self.decode
        if d is not None:
            replays, eager = d.decode_replays - self._replays0, d.decode_eager - self._eager0
            line += (f"; decode CUDA graph replays: {replays} of {replays + eager} decode "
                     f"steps ({eager} eager); prefill steps replayed as rows: "
                     f"{d.prefill_replays - self._prefill0}; ")
            captures = d.graph_captures
            line += ("no CUDA graphs" if captures is None else
                     f"graph captures: {captures} since start (+{captures - self._captures0})")
        if self._parts:
            line += "; ms/step in " + ", ".join(
                f"{part} {1000 * t / self._steps:.2f}" for part, t in self._parts.items())
        logger.info("%s", line)
        self._reset(now)
        return line
