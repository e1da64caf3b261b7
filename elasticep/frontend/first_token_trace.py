"""Where a request's first token spends its time, stage by stage.

The front-end stamps a request when its HTTP handler starts, when its prompt is
tokenized, when the request is routed (sent over the link to a rank), when the rank's
batch with its first token arrives, when that token is delivered to the request's
stream (detokenized), and when the first SSE chunk is written. The rank adds when it
took the request off the link, when the step that computed it began, and when that
step committed (:class:`~elasticep.frontend_link.FirstTokenTimes`, sent beside the
tokens), and when it published the batch. All stamps are microseconds of the host's
``CLOCK_MONOTONIC``, which the processes of one host share; a rank on another host
makes the two link stages meaningless, the others stay right.

The stages (:data:`STAGES`), each the time between two consecutive stamps:

==========================  ================================================  =========
stage                       what it holds                                     where
==========================  ================================================  =========
``http_to_tokenized``       request checks, the tokenizer pool                front-end
``tokenized_to_routed``     routing; a wait for a rank with room              front-end
``routed_to_rank``          the link, and the rank finishing its current step link+rank
``rank_to_scheduled``       steps the rank did not admit it into              rank
``scheduled_to_committed``  the step(s) computing its prompt, commit          rank
``committed_to_published``  the hand-off of the step's tokens                 rank
``published_to_frontend``   the link, the front-end's output pump             link+f-e
``frontend_to_delivered``   tracking, detokenizing, the stream's queue        front-end
``delivered_to_written``    the SSE render and write                          front-end
==========================  ================================================  =========

:meth:`FirstTokenTrace.summary` gives p50/p99 per stage over the requests traced since
the last reset, and the rank's step count from receipt to first token; the HTTP server
serves it at ``GET /debug/first_token_trace`` and ``bench/serving.py`` puts it into its
JSON. A request that ends before all its stamps (an error, a client gone, a
non-streamed one without the write stamp) is left out or counted without that stage.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from elasticep.frontend_link import FirstTokenTimes

STAGES = ("http_to_tokenized", "tokenized_to_routed", "routed_to_rank", "rank_to_scheduled",
          "scheduled_to_committed", "committed_to_published", "published_to_frontend",
          "frontend_to_delivered", "delivered_to_written")
# the stages spent in the front-end's own process, whose sum is what it adds
FRONTEND_STAGES = ("http_to_tokenized", "tokenized_to_routed", "frontend_to_delivered",
                   "delivered_to_written")
# finished traces kept for one summary; the oldest go first
KEEP = 8192


@dataclass
class _Stamps:
    arrived: int
    tokenized: int
    routed: int | None = None
    rank: FirstTokenTimes | None = None
    published: int | None = None
    frontend: int | None = None
    delivered: int | None = None
    written: int | None = None

    def stages_us(self) -> dict[str, int]:
        """The stages whose two ends are stamped, in microseconds."""
        r = self.rank
        points = [self.arrived, self.tokenized, self.routed,
                  r and r.received_us, r and r.scheduled_us, r and r.committed_us,
                  self.published, self.frontend, self.delivered, self.written]
        return {name: b - a for name, a, b in zip(STAGES, points, points[1:], strict=False)
                if a is not None and b is not None}


class FirstTokenTrace:
    """The front-end's first-token stamps of the requests in flight, and the finished
    traces since the last :meth:`summary` that reset (at most :data:`KEEP`).

    Args:
        clock: microseconds of ``CLOCK_MONOTONIC`` (injectable for tests).
    """

    def __init__(self, clock: Callable[[], int]) -> None:
        self._clock = clock
        self._open: dict[str, _Stamps] = {}
        self._done: deque[tuple[dict[str, int], int]] = deque(maxlen=KEEP)

    def arrived(self, request_id: str, arrived_us: int | None, tokenized_us: int | None) -> None:
        """A request is submitted; its handler began at ``arrived_us`` and had its prompt
        tokens at ``tokenized_us`` (None: now, for callers without an HTTP side)."""
        now = self._clock()
        self._open[request_id] = _Stamps(arrived_us or now, tokenized_us or now)

    def routed(self, request_id: str) -> None:
        """The request was sent to a rank (the first time only: a resubmission after a
        rank's death keeps its first routing)."""
        s = self._open.get(request_id)
        if s is not None and s.routed is None:
            s.routed = self._clock()

    def rank_batch(self, first_tokens: Iterable[FirstTokenTimes], sent_us: int) -> list[str]:
        """A rank's batch arrived with these first tokens; returns their request ids, to
        be marked :meth:`delivered` once the tracker has handled the batch."""
        now = self._clock()
        ids = []
        for ft in first_tokens:
            s = self._open.get(ft.request_id)
            if s is not None and s.rank is None:
                s.rank, s.published, s.frontend = ft, sent_us or None, now
                ids.append(ft.request_id)
        return ids

    def delivered(self, request_ids: Iterable[str]) -> None:
        """Their first tokens are in their streams' queues."""
        now = None
        for rid in request_ids:
            s = self._open.get(rid)
            if s is not None and s.delivered is None:
                now = self._clock() if now is None else now
                s.delivered = now

    def written(self, request_id: str) -> None:
        """The first token's SSE chunk was written: the request's trace is complete."""
        s = self._open.get(request_id)
        if s is not None and s.delivered is not None:
            s.written = self._clock()
            self._finish(request_id)

    def closed(self, request_id: str) -> None:
        """The request's stream closed: keep its trace if its rank reported the first
        token (a non-streamed request, which writes nothing earlier), else drop it."""
        if request_id in self._open:
            self._finish(request_id)

    def _finish(self, request_id: str) -> None:
        s = self._open.pop(request_id)
        if s.rank is not None:
            self._done.append((s.stages_us(), s.rank.steps))

    def summary(self, reset: bool = False) -> dict[str, Any]:
        """The traces finished since the last reset (then forgotten if ``reset``).

        Returns:
            ``{"requests": n, "stages_ms": {stage: {"p50", "p99", "mean"}},
            "frontend_ms": {...}`` (the sum of :data:`FRONTEND_STAGES` per request),
            ``"total_ms": {...}`` (handler start to the SSE write, where stamped),
            ``"rank_steps": {"p50", "p99", "max"}}`` (steps from the rank's receipt to
            the first token, that step included; 1: the next step).
        """
        done = list(self._done)
        if reset:
            self._done.clear()
        per_stage = {name: [st[name] for st, _ in done if name in st] for name in STAGES}
        frontend = [sum(st.get(n, 0) for n in FRONTEND_STAGES) for st, _ in done]
        total = [sum(st.values()) for st, _ in done if len(st) == len(STAGES)]
        steps = sorted(n for _, n in done)
        return {"requests": len(done),
                "stages_ms": {name: _ms(v) for name, v in per_stage.items()},
                "frontend_ms": _ms(frontend), "total_ms": _ms(total),
                "rank_steps": ({"p50": _pct(steps, 50), "p99": _pct(steps, 99),
                                "max": steps[-1]} if steps else None)}


def _pct(ordered: list[int], q: float) -> int:
    """The nearest-rank percentile ``q`` of an ascending, non-empty list."""
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _ms(values_us: list[int]) -> dict[str, float] | None:
    """p50, p99 and mean in milliseconds (None for no values)."""
    if not values_us:
        return None
    v = sorted(values_us)
    return {"p50": round(_pct(v, 50) / 1000, 3), "p99": round(_pct(v, 99) / 1000, 3),
            "mean": round(sum(v) / len(v) / 1000, 3)}
