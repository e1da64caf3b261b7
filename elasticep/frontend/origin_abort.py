"""Telling every rank that a front-end process is gone, until each has taken the word.

``serve --api-server-count N``: when an extra front-end process dies, serve's own
front-end sends :class:`~elasticep.frontend_link.AbortOrigin` to every rank linked to it,
and each rank aborts that process's requests (:mod:`elasticep.frontend.api_server_pool`).
A rank's send queue can be full at that moment (a long step while a burst of requests
waits for it): the send fails at once (the channel never blocks the event loop), and an
abort dropped there would leave the dead process's requests decoding for nobody until
their ``max_tokens``. So each rank whose queue was full is tried again every
:data:`RETRY_S` until it takes the message, leaves the link (a relaunched rank holds
none of the dead process's requests), or :data:`WINDOW_S` has passed.
"""

from __future__ import annotations

import asyncio
import logging
import time

from elasticep.frontend_link import AbortOrigin, FrontendChannel, LinkError, RankUnreachableError

logger = logging.getLogger("elasticep.frontend")

RETRY_S = 0.05  # between tries at a full queue: a decode step or two
WINDOW_S = 60.0  # a rank whose queue stays full this long is stalled: its eviction follows


async def abort_origin_everywhere(channel: FrontendChannel, origin_id: str,
                                  retry_s: float = RETRY_S,
                                  window_s: float = WINDOW_S) -> set[int]:
    """Send ``AbortOrigin(origin_id)`` to every rank in ``channel.connected``, retrying
    ranks whose queue is full every ``retry_s`` seconds for up to ``window_s`` seconds.

    Returns:
        The ranks that took it (each logs the abort when it reads it).
    """
    pending = set(channel.connected)
    sent: set[int] = set()
    deadline = time.monotonic() + window_s
    while True:
        for rank in sorted(pending):
            if rank not in channel.connected:  # gone, and the requests with it
                pending.discard(rank)
                continue
            try:
                channel.send(rank, AbortOrigin(origin_id))
            except RankUnreachableError:
                continue  # its queue is full: next round
            except LinkError as exc:  # the channel closed: serve is stopping
                logger.warning("cannot tell the ranks to abort front-end %s's requests: %s",
                               origin_id, exc)
                return sent
            pending.discard(rank)
            sent.add(rank)
        if not pending:
            return sent
        if time.monotonic() >= deadline:
            logger.warning("ranks %s never took the abort of front-end %s's requests: "
                           "their queues stayed full for %.0f s", sorted(pending),
                           origin_id, window_s)
            return sent
        await asyncio.sleep(retry_s)
