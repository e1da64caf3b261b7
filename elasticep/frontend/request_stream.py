"""One request's stream of events on the front-end (:class:`RequestStream`), and the
watch that ends the streams that stall (:func:`watch_stalls`).

It times the sequence for ``/metrics`` (time to first token, time per output token;
the end-to-end latency is the whole HTTP request's, observed where it is answered, in
``response_streams``) and, when it ends early, aborts it on its rank through the
:class:`~elasticep.frontend.core.Frontend` that opened it.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from elasticep.frontend.request_tracker import RequestEvent

if TYPE_CHECKING:
    from elasticep.frontend.core import Frontend


class RequestStream:
    """Async iterator over one request's :class:`RequestEvent` s, ending after the final one.

    A request that makes no progress for ``token_timeout_s`` ends with an error event
    (put by the front-end's stall watch, within a second or a quarter of the timeout).
    """

    def __init__(self, frontend: Frontend, request_id: str) -> None:
        self.request_id = request_id
        self.open = False  # True once submitted, False once finished or closed
        self._frontend = frontend
        self._queue: asyncio.Queue[RequestEvent] = asyncio.Queue()
        # monotonic seconds of its submission
        self.started = self.last_progress = time.monotonic()
        self._first_token_at: float | None = None
        self._done = False

    def put(self, event: RequestEvent) -> None:
        """The tracker's sink (runs on the loop thread)."""
        self.last_progress = time.monotonic()
        self._queue.put_nowait(event)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestEvent:
        if self._done:
            raise StopAsyncIteration
        # no timeout here: the front-end's stall watch puts an error event instead
        event = await self._queue.get()
        self._account(event)
        return event

    def ready(self) -> list[RequestEvent]:
        """The events already queued behind the last one returned, up to the final one,
        without waiting: a writer that fell behind (several steps' tokens arrived while
        it wrote) sends them in one write, so its cost per token falls as the load
        rises instead of the backlog growing."""
        out: list[RequestEvent] = []
        while not self._done and not self._queue.empty():
            event = self._queue.get_nowait()
            self._account(event)
            out.append(event)
        return out

    def _account(self, event: RequestEvent) -> None:
        """Time and count a taken event in the metrics; close the stream after its final
        one."""
        metrics = self._frontend.metrics
        now = time.monotonic()
        if event.num_generated == 1 and event.token_ids:
            self._first_token_at = now
            metrics.time_to_first_token_seconds.observe(now - self.started)
        metrics.generation_tokens.inc(len(event.token_ids))
        if event.finish_reason is not None:
            if (event.error is None and self._first_token_at is not None
                    and event.num_generated > 1):
                metrics.time_per_output_token_seconds.observe(
                    (now - self._first_token_at) / (event.num_generated - 1))
            self._done = True
            # a request the tracker finished needs no abort; an error may (timeout)
            self._close_sync(abort=event.error is not None)

    async def aclose(self) -> None:
        """Stop following the request; aborts it on its rank unless it finished."""
        self.close_now()

    def close_now(self) -> None:
        """:meth:`aclose` from synchronous code (one request of a batch could not be
        submitted: the others are dropped)."""
        self._done = True
        self._close_sync(abort=True)

    def _close_sync(self, abort: bool) -> None:
        if not self.open:
            return
        self.open = False
        self._frontend._streams.pop(self.request_id, None)
        self._frontend.first_token_trace.closed(self.request_id)
        self._frontend.metrics.requests_running.dec()
        if abort:
            self._frontend._dispatch(self._frontend.tracker.abort(self.request_id))


async def watch_stalls(streams: dict[str, RequestStream], timeout_s: float) -> None:
    """End every stream of ``streams`` (the open ones, by request id) that made no
    progress for ``timeout_s`` seconds with an error event; runs until cancelled.

    One sweep a while for all streams, not a timer per token: a timeout around each
    token's wait cost a task and a timer handle per token, the largest cost of a
    streamed token on the loop (cProfile of the stub-engine bench).
    """
    while True:
        await asyncio.sleep(min(1.0, timeout_s / 4))
        now = time.monotonic()
        for stream in list(streams.values()):
            if now - stream.last_progress > timeout_s:
                stream.put(RequestEvent(stream.request_id, (), "", "abort", 0,
                                        error=f"no progress for {timeout_s} s"))
