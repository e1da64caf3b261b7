"""Fault injection at the collectives of an elastic group, outside the group's state.

A group's state (:class:`~elasticep.distributed.state.GroupState`) calls its injector at
one point of every collective: when the op's work is done and before the op is marked
completed. The default injector does nothing; a test installs another with
:func:`inject` (torchft's ``EventInjector`` is the model: faults are objects handed to the
product, never branches inside it).
"""

from __future__ import annotations

import time
from typing import Protocol


class OpInjector(Protocol):
    """What a group's state calls around each collective."""

    def before_complete(self, seq: int) -> None:
        """The op of sequence number ``seq`` has its result and is not completed yet."""


class NoFaults:
    """The injector of every group unless a test installs another: does nothing."""

    def before_complete(self, seq: int) -> None:
        return None


NO_FAULTS = NoFaults()


class FinishLate:
    """Mark the next op completed ``delay_s`` seconds late, once, so that the other
    survivors finish it first (the fetch-from-donor path, deterministically).

    Args:
        delay_s: the delay (seconds).
    """

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def before_complete(self, seq: int) -> None:
        if self.delay_s:
            delay, self.delay_s = self.delay_s, 0.0
            time.sleep(delay)


def inject(group, injector: OpInjector) -> None:
    """Install ``injector`` on this rank's state of ``group`` (None: the WORLD group)."""
    from elasticep.distributed import api  # api imports state, which imports this module
    api._gs(group).injector = injector
