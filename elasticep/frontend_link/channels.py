"""The pyzmq channels between the HTTP front-end and the worker ranks.

Topology (the front-end binds, workers connect, so a relaunched rank just reconnects)::

    front-end ROUTER  <-- DEALER (identity = rank)  worker   requests, aborts; hello
    front-end PULL    <-- PUSH                       worker   batches of TokenOutput

A worker says :class:`WorkerHello` over its DEALER: once the ROUTER has received a
message from an identity it can route to it, so "hello received" means "sendable".
A relaunched rank reuses its identity; ``ROUTER_HANDOVER`` lets the new connection
take the identity over from a dead one that the ROUTER has not noticed yet.

Each message of :mod:`.messages` (or request of `engine.request`) is one frame of
JSON, the wire form of :mod:`elasticep.wire`: read back, every field is checked against
its annotation, and a frame that is not a message this socket takes is dropped with one
log line. Toward a rank each message travels behind one more frame, the sending
channel's :attr:`FrontendChannel.origin_id`, so that a rank knows which front-end
process sent each request (a process relaunched on the same ports has another id).
The ports carry no authentication: never expose them publicly.

The front-end side is asyncio (it lives in the HTTP server's event loop); the worker
side is synchronous (it lives in a plain step loop). Every call is non-blocking or
takes a timeout.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Mapping, Sequence

import zmq
import zmq.asyncio

from elasticep import wire
from elasticep.engine.request import AbortRequest, GenerateRequest, TokenOutput

from . import messages as m

logger = logging.getLogger(__name__)

# What each socket takes, by tag; anything else arriving on it is logged and dropped.
_TO_RANK = wire.by_tag((GenerateRequest, AbortRequest, m.AbortOrigin))
_HELLO = wire.by_tag((m.WorkerHello,))
_OUTPUTS = wire.by_tag((m.OutputBatch, m.RequestError, m.StepFailed, m.RankStats))


class LinkError(RuntimeError):
    """Base class of transport errors."""


class RankUnreachableError(LinkError):
    """The front-end has no live connection to the rank, or its queue is full."""

    def __init__(self, rank: int, reason: str) -> None:
        super().__init__(f"rank {rank} unreachable: {reason}")
        self.rank = rank


class FrontendUnreachableError(LinkError):
    """A worker could not hand its outputs to the front-end within the send timeout."""


def _identity(rank: int) -> bytes:
    return f"rank-{rank}".encode()


def _rank_of(identity: bytes) -> int | None:
    text = identity.decode(errors="replace")
    if not text.startswith("rank-"):
        return None
    try:
        return int(text[5:])
    except ValueError:
        return None


def _decode(frame: bytes, kinds: Mapping[str, list[type[wire.Message]]],
            where: str) -> wire.Message | None:
    """One frame as a message of ``kinds``; anything else (not JSON, another type, a
    mistyped field) is logged, prefixed with ``where``, and dropped, never raised."""
    try:
        return wire.decode_json(frame, kinds, "front-end link message")
    except wire.ProtocolError as exc:
        logger.warning("%s: dropping a frame of %d bytes: %s", where, len(frame), exc)
        return None


def _recv_ready(sock: zmq.Socket, kinds: Mapping[str, list[type[wire.Message]]],
                where: str) -> list:
    """Every message already queued on ``sock`` (never blocks) that is one of ``kinds``
    (see :func:`_decode` for the rest)."""
    out: list = []
    while True:
        try:
            frame = sock.recv(flags=zmq.NOBLOCK)
        except zmq.Again:
            return out
        msg = _decode(frame, kinds, where)
        if msg is not None:
            out.append(msg)


def _recv_to_rank(sock: zmq.Socket, where: str) -> list[tuple[str, m.ToRank]]:
    """Every ``(origin id, message)`` already queued on a rank's DEALER (never blocks);
    a message without its origin frame, or not one a rank takes, is logged and dropped."""
    out: list[tuple[str, m.ToRank]] = []
    while True:
        try:
            frames = sock.recv_multipart(flags=zmq.NOBLOCK)
        except zmq.Again:
            return out
        if len(frames) != 2:
            logger.warning("%s: dropping a message of %d frames (want origin, body)", where,
                           len(frames))
            continue
        msg = _decode(frames[1], _TO_RANK, where)
        if msg is not None:
            out.append((frames[0].decode(errors="replace"), msg))


class FrontendChannel:
    """Front-end side: a ROUTER for requests and a PULL for outputs, bound on ``host``.

    Use it from one asyncio event loop only (zmq sockets are not thread-safe).

    Args:
        host: interface to bind; ports are chosen by the OS (no hard-coded ports).
        request_port: 0 for a random free port, else a fixed one.
        output_port: 0 for a random free port, else a fixed one.
        origin_id: this channel's id, sent with every message to a rank (the rank
            tags the requests with it; :class:`~.messages.AbortOrigin` names it); None:
            a fresh random one. Give each process its own, a relaunched one a new one.
    """

    def __init__(self, host: str = "127.0.0.1", request_port: int = 0, output_port: int = 0,
                 origin_id: str | None = None):
        self.origin_id = origin_id or uuid.uuid4().hex
        self._origin_frame = self.origin_id.encode()
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        # Raise EHOSTUNREACH instead of silently dropping messages to unknown ranks.
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._router.setsockopt(zmq.LINGER, 0)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self.endpoints = m.LinkEndpoints(
            request_addr=self._bind(self._router, host, request_port),
            output_addr=self._bind(self._pull, host, output_port),
        )
        # Async shadows of the two sockets, made on first poll inside the running loop;
        # the plain sockets do the (non-blocking) sends and receives.
        self._poller: zmq.asyncio.Poller | None = None
        self._shadows: list[zmq.asyncio.Socket] = []
        # rank -> latest hello; a relaunched rank overwrites its entry. Replaced, never
        # mutated, so readers on other threads always see a consistent dict.
        self.connected: dict[int, m.WorkerHello] = {}
        self._closed = False
        logger.info("front-end link bound: requests %s, outputs %s",
                    self.endpoints.request_addr, self.endpoints.output_addr)

    @staticmethod
    def _bind(sock: zmq.Socket, host: str, port: int) -> str:
        if port == 0:
            port = sock.bind_to_random_port(f"tcp://{host}")
        else:
            sock.bind(f"tcp://{host}:{port}")
        return f"tcp://{host}:{port}"

    def send(self, rank: int, message: m.ToRank) -> None:
        """Queue ``message`` for ``rank`` without blocking.

        Raises:
            RankUnreachableError: the rank never said hello, its connection is gone,
                or its send queue is full.
            LinkError: the channel is closed or the socket failed.
        """
        if self._closed:
            raise LinkError("front-end channel is closed")
        frames = [_identity(rank), self._origin_frame, wire.encode_json(message)]
        try:
            self._router.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            if exc.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                raise RankUnreachableError(rank, exc.strerror) from exc
            raise LinkError(f"send to rank {rank} failed: {exc}") from exc

    async def poll(self, timeout_s: float) -> list[m.WorkerMessage]:
        """Wait up to ``timeout_s`` seconds for worker messages and return all that arrived.

        Hellos also update :attr:`connected`. Returns an empty list on timeout.
        """
        if self._closed:
            raise LinkError("front-end channel is closed")
        if self._poller is None:
            self._poller = zmq.asyncio.Poller()
            self._shadows = [zmq.asyncio.Socket.from_socket(s) for s in (self._router, self._pull)]
            for shadow in self._shadows:
                self._poller.register(shadow, zmq.POLLIN)
        # Drain first: zmq wakeups are edge-triggered, so messages that arrived while we
        # were busy would otherwise wait for the next edge.
        messages = self._drain_router() + self._drain_outputs()
        if messages:
            return messages
        await self._poller.poll(timeout=max(0, int(timeout_s * 1000)))
        return self._drain_router() + self._drain_outputs()

    def _drain_outputs(self) -> list[m.WorkerMessage]:
        return _recv_ready(self._pull, _OUTPUTS, "output socket")

    def _drain_router(self) -> list[m.WorkerMessage]:
        out: list[m.WorkerMessage] = []
        while True:
            try:
                frames = self._router.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return out
            rank = _rank_of(frames[0])
            msg = _decode(frames[-1], _HELLO, f"request socket, from {frames[0]!r}")
            if msg is None:
                continue
            if msg.rank != rank:
                logger.warning("ignoring a hello of rank %d on request socket from %r",
                               msg.rank, frames[0])
                continue
            if msg.rank in self.connected and self.connected[msg.rank].pid != msg.pid:
                logger.info("rank %d reconnected (pid %d -> %d, epoch %d)", msg.rank,
                            self.connected[msg.rank].pid, msg.pid, msg.epoch)
            elif msg.rank not in self.connected:
                logger.info("rank %d connected (pid %d, epoch %d)", msg.rank, msg.pid,
                            msg.epoch)
            # Copy-on-write: other threads may read `connected` (membership stand-ins).
            self.connected = {**self.connected, msg.rank: msg}
            out.append(msg)

    def close(self) -> None:
        """Close both sockets and the context; idempotent."""
        if self._closed:
            return
        self._closed = True
        for shadow in self._shadows:
            shadow.close(linger=0)
        self._router.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()


class WorkerChannel:
    """Worker side: a DEALER (identity = rank) for requests and a PUSH for outputs.

    Args:
        endpoints: the front-end's addresses.
        rank: global rank slot; it is the DEALER identity, kept across relaunches.
        epoch: membership epoch to tag outputs with; update :attr:`epoch` as it changes.
        send_timeout_s: how long :meth:`send_outputs` may block on a full queue (seconds).
        limits: ``(max_total_tokens, max_running_requests)`` of this rank, told in
            every hello; None: none told.
        moe_a2a_backend: the MoE transport this rank runs, told in every hello.
    """

    def __init__(self, endpoints: m.LinkEndpoints, rank: int, epoch: int = 0,
                 send_timeout_s: float = 5.0, limits: tuple[int, int] | None = None,
                 moe_a2a_backend: str | None = None):
        self.rank = rank
        self.epoch = epoch
        self.limits = limits
        self.moe_a2a_backend = moe_a2a_backend
        self._ctx = zmq.Context()
        self._dealer = self._ctx.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.IDENTITY, _identity(rank))
        self._dealer.setsockopt(zmq.LINGER, 0)
        self._dealer.connect(endpoints.request_addr)
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDTIMEO, int(send_timeout_s * 1000))
        # Let the last outputs flush on a clean close, but never hang an exit for long.
        self._push.setsockopt(zmq.LINGER, 1000)
        self._push.connect(endpoints.output_addr)
        self._poller = zmq.Poller()
        self._poller.register(self._dealer, zmq.POLLIN)

    def hello(self) -> None:
        """Announce this rank (pid, epoch) to the front-end; call at start and after relaunch.

        Raises:
            FrontendUnreachableError: the hello could not be queued.
        """
        total, running = self.limits or (None, None)
        msg = m.WorkerHello(rank=self.rank, epoch=self.epoch, pid=os.getpid(),
                            max_total_tokens=total, max_running_requests=running,
                            moe_a2a_backend=self.moe_a2a_backend)
        try:
            self._dealer.send(wire.encode_json(msg), flags=zmq.NOBLOCK)
        except zmq.Again as exc:
            raise FrontendUnreachableError(f"rank {self.rank}: hello not queued") from exc

    def poll(self, timeout_s: float) -> list[m.RankMessage]:
        """Wait up to ``timeout_s`` seconds for requests/aborts; return all that arrived.
        An :class:`~.messages.AbortOrigin` is dropped with one log line: a lone link has
        no other front-end process (:class:`~.fanout.FrontendLinks` acts on them)."""
        out: list[m.RankMessage] = []
        for origin_id, msg in self.receive(timeout_s):
            if isinstance(msg, m.AbortOrigin):
                logger.warning("rank %d: ignoring an abort of front-end %s from %s (one "
                               "front-end link)", self.rank, msg.origin_id, origin_id)
            else:
                out.append(msg)
        return out

    def receive(self, timeout_s: float) -> list[tuple[str, m.ToRank]]:
        """:meth:`poll`, each message with the origin id of the channel that sent it,
        and link control messages kept."""
        if not self._poller.poll(timeout=max(0, int(timeout_s * 1000))):
            return []
        return _recv_to_rank(self._dealer, f"rank {self.rank} epoch {self.epoch}")

    def send_outputs(self, outputs: Sequence[TokenOutput], epoch: int | None = None,
                     first_tokens: Sequence[m.FirstTokenTimes] = ()) -> None:
        """Publish one committed step's tokens, tagged with this rank and ``epoch`` (the
        step loop passes the epoch it read right after the step's commit; None:
        :attr:`epoch`), the rank's times of the first tokens among them, and the time
        of the send (``sent_us``).

        Raises:
            FrontendUnreachableError: the queue stayed full for ``send_timeout_s``.
        """
        if not outputs:
            return
        self._push_msg(m.OutputBatch(rank=self.rank,
                                     epoch=self.epoch if epoch is None else epoch,
                                     outputs=tuple(outputs),
                                     first_tokens=tuple(first_tokens),
                                     sent_us=m.monotonic_us()))

    def send_stats(self, steps: int, graph_captures: int, graph_replays: int,
                   decode_replays: int = 0, decode_eager: int = 0,
                   experts_held: int = -1, prefill_replays: int = 0) -> None:
        """Publish this rank's counters (:class:`RankStats`; the arguments are its fields).

        Raises:
            FrontendUnreachableError: the queue stayed full for ``send_timeout_s``.
        """
        self._push_msg(m.RankStats(self.rank, self.epoch, steps, graph_captures, graph_replays,
                                   decode_replays, decode_eager, experts_held,
                                   prefill_replays))

    def send_error(self, request_id: str, message: str) -> None:
        """Tell the front-end that this rank cannot serve ``request_id``."""
        self._push_msg(m.RequestError(rank=self.rank, request_id=request_id, message=message))

    def send_step_failed(self, request_ids: Sequence[str], message: str) -> None:
        """Tell the front-end that a step holding ``request_ids`` raised here (best
        effort: :meth:`close` gives it up to 1 s to leave before the rank exits)."""
        self._push_msg(m.StepFailed(rank=self.rank, request_ids=tuple(request_ids),
                                    message=message))

    def _push_msg(self, msg: m.WorkerMessage) -> None:
        try:
            self._push.send(wire.encode_json(msg))
        except zmq.Again as exc:
            raise FrontendUnreachableError(
                f"rank {self.rank} epoch {self.epoch}: output queue full") from exc

    @property
    def request_socket(self) -> zmq.Socket:
        """The DEALER that requests arrive on, for a poller over several front-ends
        (:class:`~elasticep.frontend_link.fanout.FrontendLinks`); read it with
        :meth:`poll` or :meth:`receive` only."""
        return self._dealer

    def close(self, flush: bool = True) -> None:
        """Close the sockets; outputs get up to 1 s to flush (none with ``flush``
        False: the front-end is gone, and waiting would stall the step loop)."""
        self._dealer.close(linger=0)
        self._push.close(linger=None if flush else 0)
        self._ctx.term()
