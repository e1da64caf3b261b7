"""One extra HTTP front-end process of a node (``serve --api-server-count N``): its own
asyncio loop, uvicorn server, :class:`~elasticep.frontend.core.Frontend`, tokenizer,
link to the ranks (:class:`~elasticep.frontend_link.FrontendChannel`, ports of its own)
and membership source, on the listening socket it shares with the node's other
front-end processes. :mod:`.api_server_pool` starts and supervises these processes.

The start has two steps, because the ranks must know every link before they start and
the front-end needs the coordinator, which starts with them: the process binds its link
and sends the endpoints up its pipe, then waits for the :class:`ApiServerSpec`.

Once it serves, its event loop beats on a counter in shared memory
(:mod:`.loop_beats`), which the pool reads to find a process whose loop has stalled
while the process lives on.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from elasticep.frontend.loop_beats import beat
from elasticep.frontend.membership_source import MembershipSource
from elasticep.frontend.metrics import enable_multiprocess
from elasticep.frontend_link import FrontendChannel, LinkEndpoints, WorkerHello
from elasticep.utils.gc_pauses import warn_long_collections
from elasticep.utils.procs import die_with_parent
from elasticep.utils.startup_heap import freeze_startup_heap, thaw_startup_heap
from elasticep.utils.wait import wait_until

if TYPE_CHECKING:  # the process imports the front-end once its link is bound
    from elasticep.frontend.core import Frontend

logger = logging.getLogger("elasticep.serve")

# How long a process waits for the ranks' hellos before it reports that it serves.
RANKS_TIMEOUT_S = 60.0

# Builds a process's membership source from its link's hellos (``channel.connected``);
# a top-level function or a partial of one, so that it pickles.
MembershipFactory = Callable[[Callable[[], Mapping[int, WorkerHello]]], MembershipSource]
OnServing = Callable[[int, "Frontend", LinkEndpoints, str], Callable[[], None]]


@dataclass(frozen=True)
class ApiServerSpec:
    """What every front-end process of the node serves (picklable).

    Attributes:
        model: the checkpoint directory (its tokenizer and config).
        membership: builds the process's membership source.
        server_kwargs: :func:`~elasticep.frontend.http_server.create_server`'s keyword
            arguments but ``sock`` (the node's own front-end gets the same).
        coordinator_address: named in ``join`` hints; None: none.
        on_serving: called in the process once it accepts, with its index, front-end,
            link endpoints and URL (under etcd: its directory entry); returns what to
            call at its stop. None: nothing.
        ranks: how many ranks must have said hello on the process's link before it
            reports that it serves (so that the node is ready in every process);
            0: none.
        gc_warning_threshold_s: ``--gc-warning-threshold-secs`` (0: off).
    """

    model: str
    membership: MembershipFactory
    server_kwargs: dict[str, Any] = field(default_factory=dict)
    coordinator_address: str | None = None
    on_serving: OnServing | None = None
    ranks: int = 0
    gc_warning_threshold_s: float = 0.0


def requests_served(frontend: Frontend) -> int:
    """The finished generation requests this process counted (every outcome), read
    from its own counter, not the node's sum."""
    return int(sum(s.value for metric in frontend.metrics.requests.collect()
                   for s in metric.samples if s.name.endswith("_total")))


def api_server_main(index: int, link_host: str, ports: tuple[int, int], sock: socket.socket,
                    conn: Connection, metrics_dir: str, parent_pid: int,
                    grace_s: float, origin_id: str | None = None,
                    beats: ctypes.c_uint64 | None = None) -> None:
    """The process's body: serve until SIGTERM (open streams get ``grace_s`` seconds,
    then an error event, as the node's own front-end's), or die with the parent.

    Args:
        index: the process's number among the node's front-ends (1..N-1; logs only).
        link_host, ports: where its link binds (ports 0: free ones; a relaunch passes
            the ports its predecessor had, which the ranks still connect to).
        sock: the node's listening HTTP socket.
        conn: the pipe to the pool: endpoints go up, the spec comes down, then the
            pid goes up once the server accepts.
        metrics_dir: the node's prometheus-client multiprocess directory.
        parent_pid: ``serve``'s pid.
        grace_s: seconds open streams get at a stop.
        origin_id: its link's origin id (the ranks tag its requests with it; a
            relaunch gets a new one); None: a random one.
        beats: the shared counter its loop beats on once it serves
            (:func:`~elasticep.frontend.loop_beats.beat`); None: no beats.
    """
    die_with_parent(parent_pid)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # serve stops us by pid, not the terminal
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s api-server-{index} %(name)s: "
                               "%(levelname)s %(message)s")
    enable_multiprocess(metrics_dir)
    channel = FrontendChannel(host=link_host, request_port=ports[0], output_port=ports[1],
                              origin_id=origin_id)
    server = frontend = leave = None
    try:
        conn.send(channel.endpoints)
        spec: ApiServerSpec = conn.recv()
        # imported only now: the link is bound and reported first, the rest loads meanwhile
        from elasticep.frontend.http_server import create_server

        server, frontend = create_server(spec.model, channel,
                                         spec.membership(lambda: channel.connected),
                                         sock=sock, **spec.server_kwargs)
        frontend.coordinator_address = spec.coordinator_address
        server.start()
        if spec.on_serving is not None:
            leave = spec.on_serving(index, frontend, channel.endpoints, server.url)
        try:
            wait_until(lambda: len(channel.connected) >= spec.ranks or stop.is_set(),
                       RANKS_TIMEOUT_S, "the ranks' hellos")
        except TimeoutError:  # a rank died meanwhile: the node's start says so
            logger.warning("api server %d: %d of %d ranks linked after %.0f s", index,
                           len(channel.connected), spec.ranks, RANKS_TIMEOUT_S)
        freeze_startup_heap()
        warn_long_collections(spec.gc_warning_threshold_s)
        logger.info("api server %d (pid %d) serving", index, os.getpid())
        conn.send(os.getpid())
        if beats is not None and not frontend.call_soon(beat, beats):
            logger.warning("api server %d: its loop has closed; no beats", index)
        stop.wait()
        logger.info("api server %d (pid %d): stopping after %d requests", index,
                    os.getpid(), requests_served(frontend))
    except EOFError:  # serve went away before sending the spec
        return
    finally:
        if frontend is not None:
            frontend.shut_down("the server is shutting down", grace_s)
        if leave is not None:  # after: the ranks abort a leaver's requests
            leave()
        if server is not None:
            server.stop()
        channel.close()
        thaw_startup_heap()  # multiprocessing ends this process with a normal exit
