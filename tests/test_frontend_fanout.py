"""A rank's links to several front-ends (`frontend_link.fanout`), over real zmq sockets:
each front-end gets the outputs of its own requests only, every one gets the hellos and
counters, an id in flight from another front-end is refused, a front-end that leaves
the directory has its requests aborted on the rank while the others' go on, and so has
a dead front-end process named by an ``AbortOrigin``, not its relaunch on the same
ports."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest
from test_frontend_link import collect, wait_poll

from elasticep.engine.request import AbortRequest, GenerateRequest, TokenOutput
from elasticep.frontend.origin_abort import abort_origin_everywhere
from elasticep.frontend_link import (
    AbortOrigin,
    FrontendChannel,
    OutputBatch,
    RankStats,
    RankUnreachableError,
    RequestError,
    WorkerHello,
)
from elasticep.frontend_link.fanout import FrontendLinks, static_links

pytestmark = pytest.mark.timeout(30)

# the rank side's calls are WorkerChannel's, so that module's helpers drive it as well


def test_each_front_end_gets_its_own_requests_back_and_a_leaver_is_aborted():
    async def main() -> None:
        a, b = FrontendChannel(), FrontendChannel()
        listed = [a.endpoints, b.endpoints]
        links = FrontendLinks(a.endpoints, rank=2, directory=lambda: list(listed), epoch=5,
                              refresh_s=0.02)
        try:
            links.hello()
            [hello_a] = await collect(a, 1)
            assert isinstance(hello_a, WorkerHello) and hello_a.rank == 2
            poll_until_linked(links, 2)
            [hello_b] = await collect(b, 1)  # said on linking, without being asked
            assert isinstance(hello_b, WorkerHello) and hello_b.epoch == 5

            ra, rb = GenerateRequest("ra", (1, 2)), GenerateRequest("rb", (3,))
            a.send(2, ra)
            # ra in flight from a first: two sockets keep no order between them
            assert wait_poll(links, 1) == [ra]
            b.send(2, rb)
            b.send(2, GenerateRequest("ra", (4,)))  # ra's id is a's: refused on b
            assert wait_poll(links, 1) == [rb]
            # the rank refuses the duplicate when a poll reads it (it is never delivered)
            refusals: list = []
            deadline = time.monotonic() + 5.0
            while not refusals:
                assert time.monotonic() < deadline, "no refusal reached b"
                assert links.poll(0.02) == []
                refusals = await b.poll(0.02)
            [refused] = refusals
            assert isinstance(refused, RequestError) and refused.request_id == "ra"

            links.send_outputs([TokenOutput("ra", 0, 7), TokenOutput("rb", 0, 8)])
            links.send_stats(10, 0, 0)
            [out_a, stats_a] = await collect(a, 2)
            [out_b, stats_b] = await collect(b, 2)
            assert isinstance(out_a, OutputBatch) and out_a.outputs == (TokenOutput("ra", 0, 7),)
            assert isinstance(out_b, OutputBatch) and out_b.outputs == (TokenOutput("rb", 0, 8),)
            assert stats_a == stats_b == RankStats(2, 5, 10, 0, 0)

            listed.clear()  # an empty directory is unknown: nothing is dropped
            time.sleep(0.1)
            assert links.poll(0.05) == [] and len(links.frontends) == 2
            listed.append(a.endpoints)  # b left (its lease ran out)
            assert wait_poll(links, 1) == [AbortRequest("rb")]
            assert links.frontends == [a.endpoints.request_addr]
            links.send_outputs([TokenOutput("ra", 1, 9, finish_reason="length"),
                                TokenOutput("rb", 1, 9)])  # rb's has nowhere to go
            [last] = await collect(a, 1)
            assert last.outputs == (TokenOutput("ra", 1, 9, finish_reason="length"),)
        finally:
            links.close()
            a.close()
            b.close()

    asyncio.run(main())


def poll_until_linked(links: FrontendLinks, n: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(links.frontends) < n:
        assert time.monotonic() < deadline, links.frontends
        links.poll(0.02)


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


async def relaunched(b: FrontendChannel, links: FrontendLinks) -> FrontendChannel:
    """Close ``b`` (its process died) and bind a channel on its ports (its relaunch);
    returned once rank 1 of ``links`` said hello on it."""
    b.close()
    b2 = FrontendChannel(request_port=_port(b.endpoints.request_addr),
                         output_port=_port(b.endpoints.output_addr))
    deadline = time.monotonic() + 5.0
    while 1 not in b2.connected:
        if time.monotonic() > deadline:
            b2.close()
            raise AssertionError("the relaunched front-end never heard")
        links.poll(0.02)
        await b2.poll(0.02)
    return b2


TwoLinks = Callable[[FrontendChannel, FrontendChannel, FrontendLinks,
                     list[FrontendChannel]], Awaitable[None]]


def run_with_two_front_ends(body: TwoLinks) -> None:
    """``body(a, b, links, more)``: rank 1's static links to front-end channels a and b,
    b's hello read; a, b, the links and every channel ``body`` puts in ``more`` are
    closed after."""

    async def main() -> None:
        a, b = FrontendChannel(), FrontendChannel()
        links = static_links([a.endpoints, b.endpoints], rank=1)
        more: list[FrontendChannel] = []
        try:
            poll_until_linked(links, 2)
            await collect(b, 1)  # said on linking
            await body(a, b, links, more)
        finally:
            links.close()
            for channel in (a, b, *more):
                channel.close()

    asyncio.run(main())


def test_a_front_end_relaunched_on_its_ports_hears_the_rank_again():
    """A fixed set of front-end processes (``--api-server-count``): one that dies and
    binds the same link ports again is told of the rank by its periodic hello, without
    the rank having noticed anything."""

    async def body(a: FrontendChannel, b: FrontendChannel, links: FrontendLinks,
                   more: list[FrontendChannel]) -> None:
        b2 = await relaunched(b, links)
        more.append(b2)
        b2.send(1, GenerateRequest("r", (1,)))
        assert wait_poll(links, 1) == [GenerateRequest("r", (1,))]

    run_with_two_front_ends(body)


def test_an_abort_origin_aborts_the_dead_process_requests_not_its_relaunch():
    """``--api-server-count``: process b dies and is relaunched on its ports (b2) before
    serve's own front-end (a) names b dead; only b's request is aborted, not b2's nor
    a's; once a process is named dead, its requests still on the way are refused."""

    async def body(a: FrontendChannel, b: FrontendChannel, links: FrontendLinks,
                   more: list[FrontendChannel]) -> None:
        ra, rb = GenerateRequest("ra", (1,)), GenerateRequest("rb", (2,))
        a.send(1, ra)
        b.send(1, rb)
        assert sorted(wait_poll(links, 2), key=lambda r: r.request_id) == [ra, rb]
        b2 = await relaunched(b, links)
        more.append(b2)
        assert b2.origin_id != b.origin_id
        rb2 = GenerateRequest("rb2", (3,))
        b2.send(1, rb2)
        assert wait_poll(links, 1) == [rb2]
        a.send(1, AbortOrigin(b.origin_id))  # late: b2 already sent on b's link
        assert wait_poll(links, 1) == [AbortRequest("rb")]

        a.send(1, AbortOrigin(b2.origin_id))
        assert wait_poll(links, 1) == [AbortRequest("rb2")]
        # b2's next request came after its AbortOrigin: refused. Its AbortOrigin of a
        # right behind it on the same socket shows that the rank read it
        b2.send(1, GenerateRequest("late", (4,)))
        b2.send(1, AbortOrigin(a.origin_id))
        assert wait_poll(links, 1) == [AbortRequest("ra")]
        assert links.poll(0.05) == []

    run_with_two_front_ends(body)


def test_an_abort_origin_waits_out_a_full_queue():
    """The rank's queue from serve's own front-end (a) is full when process b dies: the
    abort of b's requests is tried again until the rank has read enough to take it (it
    was dropped at the first full queue, and b's request decoded for nobody)."""

    async def body(a: FrontendChannel, b: FrontendChannel, links: FrontendLinks,
                   more: list[FrontendChannel]) -> None:
        deadline = time.monotonic() + 5.0
        while 1 not in a.connected:  # the rank's periodic hello reaches a too
            assert time.monotonic() < deadline, "a never heard rank 1"
            links.poll(0.02)
            await a.poll(0.02)
        b.send(1, GenerateRequest("rb", (2,)))
        assert wait_poll(links, 1) == [GenerateRequest("rb", (2,))]
        queued = 0
        with pytest.raises(RankUnreachableError, match="rank 1 unreachable"):
            while queued < 1_000_000:  # the rank reads nothing meanwhile
                a.send(1, GenerateRequest(f"ra{queued}", (1,)))
                queued += 1
        task = asyncio.create_task(abort_origin_everywhere(a, b.origin_id, retry_s=0.01))
        await asyncio.sleep(0.2)
        assert not task.done(), "the abort went through a full queue"
        seen: list = []
        deadline = time.monotonic() + 20.0
        while AbortRequest("rb") not in seen:
            assert time.monotonic() < deadline, f"no abort of rb after {len(seen)} messages"
            seen += links.poll(0.01)
            await asyncio.sleep(0)  # the retrying task runs between the rank's reads
        assert await task == {1}
        assert len(seen) == queued + 1 and seen[-1] == AbortRequest("rb")

    run_with_two_front_ends(body)
