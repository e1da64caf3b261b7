"""A rank's side of the first-token trace: when each request came off the link, which
step first computed it, and when its first token was committed.

The worker loops (:mod:`.serve_loop`, :mod:`.step_loop`) feed it and attach its
:class:`~elasticep.frontend_link.FirstTokenTimes` to the step's ``OutputBatch``; the
front-end adds its own stamps (:mod:`elasticep.frontend.first_token_trace`). Its cost is
one dict lookup per request per step while a request waits for its first token, and
none after.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from elasticep.engine.request import AbortRequest, GenerateRequest, TokenOutput
from elasticep.frontend_link import FirstTokenTimes, monotonic_us

# Requests received but not yet given a token, at most: a refused request never gets
# one, so the oldest entries are dropped past this bound instead of growing for ever.
MAX_WAITING = 1 << 16


@dataclass
class _Waiting:
    received_us: int
    received_step: int
    scheduled_us: int | None = None


class FirstTokenClock:
    """Stamps one rank's requests on their way to their first token.

    Args:
        clock: microseconds of ``CLOCK_MONOTONIC`` (injectable for tests).
    """

    def __init__(self, clock: Callable[[], int] = monotonic_us) -> None:
        self._clock = clock
        self._waiting: dict[str, _Waiting] = {}
        self._step_start_us = 0

    def received(self, messages: Iterable[GenerateRequest | AbortRequest], steps: int) -> None:
        """Requests came off the link when the rank had committed ``steps`` steps; an
        abort forgets its request."""
        now = None
        for msg in messages:
            if isinstance(msg, AbortRequest):
                self._waiting.pop(msg.request_id, None)
                continue
            now = self._clock() if now is None else now
            self._waiting[msg.request_id] = _Waiting(now, steps)
        while len(self._waiting) > MAX_WAITING:
            del self._waiting[next(iter(self._waiting))]

    def step_started(self) -> None:
        """A step begins (its header, or the single-rank loop's step call)."""
        self._step_start_us = self._clock()

    def scheduled(self, request_ids: Iterable[str]) -> None:
        """These requests are in the step that began last; the first such step of each
        is its ``scheduled_us``."""
        if not self._waiting:
            return
        for rid in request_ids:
            w = self._waiting.get(rid)
            if w is not None and w.scheduled_us is None:
                w.scheduled_us = self._step_start_us

    def committed(self, outputs: Sequence[TokenOutput], steps: int) -> tuple[FirstTokenTimes, ...]:
        """The step's outputs are committed (``steps`` now counts it): the times of the
        requests whose first token this is. A request not marked :meth:`scheduled` (the
        single-rank loop schedules inside its engine's step) counts the step that began
        last as its scheduling step."""
        if not self._waiting:
            return ()
        now = None
        out = []
        for o in outputs:
            w = self._waiting.pop(o.request_id, None)
            if w is None:
                continue
            now = self._clock() if now is None else now
            scheduled = self._step_start_us if w.scheduled_us is None else w.scheduled_us
            out.append(FirstTokenTimes(o.request_id, w.received_us, max(scheduled, w.received_us),
                                       now, steps - w.received_step))
        return tuple(out)
