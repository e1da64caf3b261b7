"""A rank's periodic throughput line: steps, generated tokens, and decode graph use.

The graph part counts replays (how many steps ran a captured graph) and captures (how
many times the buckets were captured, start-up included), so a failover run shows its
re-captures as a number. Both worker loops (:mod:`elasticep.elastic.serve_loop`,
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


class GraphCounters(Protocol):
    """Running counts of an engine's decode CUDA graphs
    (:class:`elasticep.engine.cuda_graph.DecodeGraphs` has both)."""

    replays: int
    captures: int


class StepRateLog:
    """Counts steps and generated tokens; logs their rates once per interval.

    Args:
        rank: for the line.
        graphs: the engine's decode-graph counters; None for an engine without graphs
            (the line then leaves them out).
        interval_s: seconds between lines; 0 or less disables the log.
        clock: monotonic seconds (tests pass a fake).
    """

    def __init__(self, rank: int, graphs: GraphCounters | None, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rank, self.graphs, self.interval_s, self.clock = rank, graphs, interval_s, clock
        self._reset(self.clock())

    def _reset(self, now: float) -> None:
        self._t0, self._steps, self._tokens = now, 0, 0
        g = self.graphs
        self._replays0, self._captures0 = (g.replays, g.captures) if g is not None else (0, 0)

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
        g = self.graphs
        if g is not None:
            line += (f"; decode CUDA graph replays: {g.replays - self._replays0} of "
                     f"{self._steps} steps; graph captures: {g.captures} since start "
                     f"(+{g.captures - self._captures0})")
        logger.info("%s", line)
        self._reset(now)
        return line
