"""Several requests' event streams as one (``n`` choices, a batch of prompts).

Each member stream is read by a task of its own into one queue, so events come out in
the order they arrive, whichever request they belong to. Closing the merged stream
closes every member, which aborts those not finished on their ranks.
"""

from __future__ import annotations

import asyncio
import contextlib

from elasticep.frontend.core import RequestStream
from elasticep.frontend.request_tracker import RequestEvent


class MergedStream:
    """Async iterator over the :class:`RequestEvent` s of ``streams``, ending after every
    member's final event.

    Args:
        streams: the members (submitted requests), at least one.

    Raises:
        ValueError: ``streams`` is empty.
    """

    def __init__(self, streams: list[RequestStream]) -> None:
        if not streams:
            raise ValueError("a merged stream needs at least one request")
        self.streams = streams
        self.request_id = streams[0].request_id
        self._queue: asyncio.Queue[RequestEvent | None] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._left = len(streams)

    async def _pump(self, stream: RequestStream) -> None:
        try:
            async for event in stream:
                self._queue.put_nowait(event)
        finally:
            self._queue.put_nowait(None)  # this member is done

    @property
    def started(self) -> float:
        """When the first member was submitted (monotonic seconds)."""
        return min(s.started for s in self.streams)

    def __aiter__(self) -> MergedStream:
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._pump(s)) for s in self.streams]
        return self

    async def __anext__(self) -> RequestEvent:
        while self._left:
            event = await self._queue.get()
            if event is not None:
                return event
            self._left -= 1
        raise StopAsyncIteration

    def ready(self) -> list[RequestEvent]:
        """The members' events already queued, without waiting (see
        :meth:`RequestStream.ready`)."""
        out: list[RequestEvent] = []
        while self._left and not self._queue.empty():
            event = self._queue.get_nowait()
            if event is None:
                self._left -= 1
            else:
                out.append(event)
        return out

    async def aclose(self) -> None:
        """Stop following every member; aborts those not finished."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for s in self.streams:
            await s.aclose()
