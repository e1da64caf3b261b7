"""Worker logging: every line carries the rank and the current membership epoch.

A handler filter stamps ``rank`` and ``epoch`` on every record, so lines from any
library (the distributed backend, the engine, the loader) show them too::

    12:00:01.234 rank=2 epoch=3 elasticep.elastic.step_loop: INFO redo step 41 ...
"""

from __future__ import annotations

import logging
import sys

FORMAT = "%(asctime)s rank=%(rank)s epoch=%(epoch)s %(name)s: %(levelname)s %(message)s"


class RankContext(logging.Filter):
    """Mutable (rank, epoch) stamped on each record; update :attr:`epoch` on a change."""

    def __init__(self, rank: int, epoch: int = 0) -> None:
        super().__init__()
        self.rank = rank
        self.epoch = epoch

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        record.epoch = self.epoch
        return True


def setup_worker_logging(rank: int, level: int = logging.INFO) -> RankContext:
    """Log to stderr with rank and epoch on every line; returns the context to update."""
    ctx = RankContext(rank)
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(ctx)
    handler.setFormatter(logging.Formatter(FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    return ctx
