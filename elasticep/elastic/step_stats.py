"""What the lockstep loop counts: its steps, redos and recoveries (:class:`LoopStats`),
and where a step's wall time goes, phase by phase (:class:`StepTimers`).

A step is four phases in turn: ``header`` (the header all_reduce), ``execute`` (the
forward with its sampling and, with the in-graph exchange, the wait for the GPU),
``commit`` (the commit all_reduce) and ``publish`` (the engine's commit and the outputs'
hand-off; with deferred publishing their send is inside the next step's forward).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

PHASES = ("header", "execute", "commit", "publish")


@dataclass
class LoopStats:
    """Counters of one rank's loop (logged at exit; read by tests and bench)."""

    steps: int = 0
    redos: int = 0
    recoveries: int = 0
    reloads: int = 0
    peer_copies: int = 0
    recovery_seconds: list[float] = field(default_factory=list)
    # the epoch this rank was at, and the wall-clock time (time.time()), when it last
    # committed a step: a partition test checks that a cut-off rank commits nothing after
    # the cut, and nothing in an epoch the coordinator made without it
    last_commit_epoch: int = -1
    last_commit_time: float = 0.0


class StepTimers:
    """The phases one step has entered, with their start times.

    Args:
        clock: seconds, monotonic (tests pass a fake).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.starts: dict[str, float] = {}

    def enter(self, phase: str) -> None:
        """``phase`` (one of :data:`PHASES`) starts now.

        Raises:
            ValueError: an unknown phase.
        """
        if phase not in PHASES:
            raise ValueError(f"unknown step phase {phase!r}: want one of {PHASES}")
        self.starts[phase] = self.clock()

    def durations(self) -> dict[str, float]:
        """Seconds spent in each entered phase, in order; the last one ends now."""
        entered = [p for p in PHASES if p in self.starts]
        ends = [self.starts[p] for p in entered[1:]] + [self.clock()]
        return {p: end - self.starts[p] for p, end in zip(entered, ends, strict=True)}
