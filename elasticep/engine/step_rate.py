"""A rank's periodic throughput line: steps, generated tokens, and decode graph use.

Both worker loops (:mod:`elasticep.engine.serve_loop`, :mod:`elasticep.elastic.step_loop`)
feed it once per committed step. Every ``interval_s`` with at least one step it logs
one INFO line, so a slow rank, or one that runs eagerly when it should replay its
decode CUDA graphs (after a placement change, say), shows in its log.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


class StepRateLog:
    """Counts steps and generated tokens; logs their rates once per interval.

    Args:
        rank: for the line.
        graph_replays: returns the engine's running count of decode CUDA graph replays
            (:attr:`elasticep.engine.cuda_graph.DecodeGraphs.replays`); None for an engine
            without graphs (the line then leaves them out).
        interval_s: seconds between lines; 0 or less disables the log.
        clock: monotonic seconds (tests pass a fake).
    """

    def __init__(self, rank: int, graph_replays: Callable[[], int] | None,
                 interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rank, self.graph_replays, self.interval_s, self.clock = (
            rank, graph_replays, interval_s, clock)
        self._reset(self.clock())

    def _reset(self, now: float) -> None:
        self._t0, self._steps, self._tokens = now, 0, 0
        self._replays0 = self.graph_replays() if self.graph_replays is not None else 0

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
        if self.graph_replays is not None:
            replays = self.graph_replays() - self._replays0
            line += f"; decode CUDA graph replays: {replays} of {self._steps} steps"
        logger.info("%s", line)
        self._reset(now)
        return line
