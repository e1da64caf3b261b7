"""The front-end's event-loop core: link pump, membership watcher, request streams.

Everything here runs on one asyncio loop (the HTTP server's), so the
:class:`RequestTracker` needs no locks. Two background tasks feed it:

- the *output pump* waits on the link channel and hands token batches, request errors
  and hellos to the tracker;
- the *membership watcher* (:mod:`.membership_watch`) polls :class:`MembershipSource`
  every ``membership_poll_s`` seconds and applies rank state changes, which moves
  requests off failed/draining/free slots.

A rank counts as routable only when membership says ``healthy`` *and* its worker said
hello with the pid membership reports, so a request is never sent to a dead predecessor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from elasticep.deploy.restart_policy import scale_command
from elasticep.engine.request import GenerateRequest, SamplingParams
from elasticep.frontend.event_log import EventLog
from elasticep.frontend.first_token_trace import FirstTokenTrace
from elasticep.frontend.incremental_text import Decode
from elasticep.frontend.membership_metrics import SnapshotMetrics
from elasticep.frontend.membership_source import MembershipSource
from elasticep.frontend.membership_watch import MembershipWatch, SnapshotOutage
from elasticep.frontend.metrics import FrontendMetrics
from elasticep.frontend.origin_abort import abort_origin_everywhere
from elasticep.frontend.recovery_timeline import Event, RecoveryTimeline
from elasticep.frontend.request_stream import RequestStream, watch_stalls
from elasticep.frontend.request_tracker import (
    DecodeWith,
    NoRankAvailableError,
    RequestEvent,
    RequestTracker,
    SendToRank,
)
from elasticep.frontend_link import (
    FrontendChannel,
    LinkError,
    OutputBatch,
    RankStats,
    RankUnreachableError,
    RequestError,
    StepFailed,
    WorkerMessage,
    monotonic_us,
)
from elasticep.membership.status import DeploymentStatus
from elasticep.utils.wait import wait_until

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FrontendConfig:
    """Timing of the front-end core (all in seconds).

    Attributes:
        membership_poll_s: interval between membership snapshots.
        status_timeout_s: longest wait for one ``MembershipSource`` call.
        output_poll_s: longest single wait of the output pump.
        token_timeout_s: a request that makes no progress for this long fails.
    """

    membership_poll_s: float = 0.05
    status_timeout_s: float = 2.0
    output_poll_s: float = 0.1
    token_timeout_s: float = 300.0


class Frontend(MembershipWatch):
    """Routes requests to ranks and streams their tokens back.

    Args:
        channel: the bound front-end link channel.
        membership: where rank states come from.
        decode: token ids -> text.
        metrics: metrics to update.
        config: timing.
        decode_with: token ids -> text with the detokenizer's options as keywords
            (:class:`RequestTracker`); None: ``decode`` for every request.
    """

    def __init__(self, channel: FrontendChannel, membership: MembershipSource, decode: Decode,
                 metrics: FrontendMetrics | None = None,
                 config: FrontendConfig | None = None,
                 decode_with: DecodeWith | None = None) -> None:
        self.channel = channel
        self.membership = membership
        self.metrics = metrics or FrontendMetrics()
        self.config = config or FrontendConfig()
        self.tracker = RequestTracker(decode, on_interruption=self._on_interruption,
                                      decode_with=decode_with)
        self.metrics.num_queue_reqs.set_function(lambda: self.tracker.num_waiting)
        # the phases of deaths, rejoins and scales (metrics and --event-log)
        self.timeline = RecoveryTimeline()
        self.event_log: EventLog | None = None
        self.first_token_trace = FirstTokenTrace(monotonic_us)
        self._status = DeploymentStatus()
        self._snapshots = SnapshotMetrics(self.metrics)
        self._outage = SnapshotOutage()
        self._unreachable: set[int] = set()
        self._tasks: list[asyncio.Task] = []
        self._wake_membership = asyncio.Event()
        self._streams: dict[str, RequestStream] = {}  # open streams, by request id
        self._loop: asyncio.AbstractEventLoop | None = None
        self.closed_reason: str | None = None  # set by fail_all: the deployment is stopping
        self._ready = False  # latched once every rank of the target size was routable
        # the coordinator's "host:port", for the `join` commands the API suggests
        self.coordinator_address: str | None = None
        # what the serving command adds to /elastic_ep_status (e.g. its restart budget)
        self._status_extra: dict[str, Any] = {}

    # ---- lifecycle -----------------------------------------------------------------
    async def start(self) -> None:
        """Start the background tasks on the running loop and take a first snapshot."""
        self._wake_membership = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        await self.refresh_membership()
        self._tasks = [asyncio.create_task(self._pump_outputs(), name="frontend-outputs"),
                       asyncio.create_task(self._watch_membership(), name="frontend-members"),
                       asyncio.create_task(watch_stalls(self._streams, self.config.token_timeout_s),
                                           name="frontend-stalls")]

    async def stop(self) -> None:
        """Cancel the background tasks (the channel stays open; its owner closes it).

        A task is cancelled again until it ends: on Python < 3.12 ``asyncio.wait_for``
        drops a cancellation that arrives as its inner future completes, and the
        membership loop, which calls it every poll, then ran on and ``stop`` waited
        for ever.
        """
        for task in self._tasks:
            while not task.done():
                task.cancel()
                await asyncio.wait({task}, timeout=0.1)
            with contextlib.suppress(asyncio.CancelledError, Exception):
                task.result()
        self._tasks = []

    def fail_all(self, reason: str) -> None:
        """The deployment is stopping (e.g. a rank died under ``--elastic-ep-backend
        none``): end every in-flight request with an error event carrying ``reason`` and
        refuse new ones (HTTP 503). Thread-safe; idempotent."""
        self.closed_reason = self.closed_reason or reason
        self.call_soon(self._fail_open_streams)  # no loop: no stream is left to fail

    def shut_down(self, reason: str, grace_s: float) -> None:
        """Stop serving (Ctrl-C of serve): refuse new requests now (HTTP 503), give the
        open streams up to ``grace_s`` seconds to finish, then end the rest with an
        error event carrying ``reason``, so a client sees why its stream stopped instead
        of a cut connection. Thread-safe; call it before stopping the HTTP server."""
        self.closed_reason = self.closed_reason or reason
        with contextlib.suppress(TimeoutError):
            wait_until(lambda: not self._streams, grace_s, "open streams to finish",
                       poll_s=0.05)
        self.fail_all(reason)

    def _fail_open_streams(self) -> None:
        reason = self.closed_reason or "the deployment is stopping"
        for request_id, stream in list(self._streams.items()):
            rank = self.tracker.rank_of(request_id)
            if rank is not None:  # a server error (5xx): the request was valid
                self.tracker.fail(request_id, reason)
            else:  # parked (no healthy rank), or finished with its last event unread
                self.tracker.abort(request_id)
                stream.put(RequestEvent(request_id, (), "", "abort", 0, error=reason))
        if self._streams:
            logger.warning("failed %d in-flight requests: %s", len(self._streams), reason)

    def abort_origin(self, origin_id: str) -> None:
        """Tell every rank linked here that the front-end process whose link id is
        ``origin_id`` is gone (:class:`~elasticep.frontend_link.AbortOrigin`): each
        aborts that process's requests. For the supervisor of the node's other
        front-end processes; thread-safe; nothing is sent before :meth:`start`."""
        self.call_soon(self._send_abort_origin, origin_id)  # no loop: the ranks stop with serve

    def call_soon(self, callback: Callable[..., object], *args: Any) -> bool:
        """Run ``callback(*args)`` on the front-end's loop, from any thread.

        Returns:
            False, running nothing, when the loop has not started (:meth:`start`) or
            has closed.
        """
        loop = self._loop
        if loop is None or loop.is_closed():
            return False
        try:
            loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop closed since the look above
            return False
        return True

    def _send_abort_origin(self, origin_id: str) -> None:
        task = asyncio.get_running_loop().create_task(
            abort_origin_everywhere(self.channel, origin_id), name=f"abort-origin-{origin_id}")
        self._tasks.append(task)  # cancelled with the others at stop

    # ---- requests ------------------------------------------------------------------
    def submit(self, request_id: str, prompt_token_ids: Sequence[int],
               params: SamplingParams, arrived_us: int | None = None,
               tokenized_us: int | None = None) -> RequestStream:
        """Route a request now and return the stream of its events.

        ``arrived_us`` and ``tokenized_us`` (``monotonic_us`` stamps of the HTTP
        handler's start and of its prompt's tokens; None: now) start its first-token
        trace (:mod:`elasticep.frontend.first_token_trace`).

        Always close the stream (``async with contextlib.aclosing(stream)``): closing it
        before the final event (client gone) aborts the request on its rank.

        Raises:
            NoRankAvailableError: no healthy rank.
            DuplicateRequestError: ``request_id`` is in flight.
        """
        if self.closed_reason is not None:
            raise NoRankAvailableError(self.closed_reason)
        stream = RequestStream(self, request_id)
        sends = self.tracker.add(request_id, prompt_token_ids, params, stream.put)
        self.first_token_trace.arrived(request_id, arrived_us, tokenized_us)
        self._dispatch(sends)
        self.metrics.requests_running.inc()
        self.metrics.prompt_tokens.inc(len(prompt_token_ids))
        stream.open = True
        self._streams[request_id] = stream
        return stream

    @property
    def ready(self) -> bool:
        """True once the deployment finished starting: every one of its ``ep_size`` ranks
        was routable at the same time. Latched: a later failure makes it degraded, not
        "starting" again."""
        return self._ready

    def waiting_for_joiners(self) -> dict[str, Any] | None:
        """The slots a grow waits for and the `join` that starts them, or None."""
        slots = list(self._status.waiting_slots)
        if not slots:
            return None
        out: dict[str, Any] = {"slots": slots}
        if self.coordinator_address is not None:
            out["join_command"] = scale_command(self.coordinator_address, slots)
        return out

    def set_status_extra(self, key: str, value: Any) -> None:
        """Show ``value`` under ``key`` in ``/elastic_ep_status`` (any thread)."""
        self._status_extra = {**self._status_extra, key: value}

    def status_extra(self) -> dict[str, Any]:
        """What :meth:`set_status_extra` added, by key."""
        return dict(self._status_extra)

    def can_serve(self) -> bool:
        """True while at least one rank can take requests (never once :meth:`fail_all`)."""
        return self.closed_reason is None and bool(self.tracker.healthy_ranks())

    def status(self) -> DeploymentStatus:
        """The last membership snapshot with ``running_requests`` filled in per rank, and
        what each rank reported in its hello (KV tokens, max running requests, the MoE
        transport)."""
        hellos = self.channel.connected
        limits = {r: (h.max_total_tokens, h.max_running_requests) for r, h in hellos.items()}
        transports = {r: h.moe_a2a_backend for r, h in hellos.items()}
        return self._status.with_running(self.tracker.running_per_rank(), limits, transports)

    async def change_membership(self, change: Callable[[MembershipSource], Any],
                                kind: Callable[[dict[str, Any]], str | None] | None = None,
                                ) -> Any:
        """Run ``change(membership)`` (a scale or a retirement) in a worker thread;
        its errors propagate.

        Args:
            kind: names the change from the coordinator's answer (grow, shrink or
                retire; None: a no-op), which times it (``elasticep_scale_seconds``,
                the event log) unless it repeats a recorded operation.

        The snapshot is refreshed before returning, so a client that reads
        ``/elastic_ep_status`` after its POST sees the change's phase (read your writes).

        Raises:
            asyncio.TimeoutError: membership did not answer within the status timeout.
        """
        result = await asyncio.wait_for(asyncio.to_thread(change, self.membership),
                                        self.config.status_timeout_s)
        name = None if kind is None or (result or {}).get("repeated") else kind(result or {})
        if name is not None:
            self._record(self.timeline.on_scale(time.monotonic(), name, {
                k: v for k, v in (result or {}).items()
                if k in ("operation_id", "slots", "old_ep_size", "superseded")}))
        await self.refresh_membership()
        self._wake_membership.set()
        return result

    async def operation(self, operation_id: str) -> dict[str, Any]:
        """A scale or retire operation's phase and slot states
        (``MembershipSource.operation``; its errors propagate)."""
        return await asyncio.wait_for(
            asyncio.to_thread(self.membership.operation, operation_id),
            self.config.status_timeout_s)

    # ---- link ----------------------------------------------------------------------
    async def _pump_outputs(self) -> None:
        while True:
            try:
                messages = await self.channel.poll(self.config.output_poll_s)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the pump must survive anything
                logger.exception("output pump: poll failed")
                await asyncio.sleep(self.config.output_poll_s)
                continue
            for msg in messages:
                try:
                    self._handle(msg)
                except Exception:  # noqa: BLE001 - one bad message must not stall all streams
                    logger.exception("epoch %s: failed to handle %s from rank %s",
                                     self._status.epoch, type(msg).__name__,
                                     getattr(msg, "rank", "?"))
            # poll returns at once while messages wait, without passing through the
            # loop: yield here, or a pump that is always behind starves the streams'
            # writers and the HTTP handlers, and clients get their tokens in one burst
            # at the end (seen at 256 streams on stub ranks)
            await asyncio.sleep(0)

    def _handle(self, msg: WorkerMessage) -> None:
        if isinstance(msg, OutputBatch):
            self._record(self.timeline.on_output(time.monotonic(), msg.rank, msg.epoch,
                                                 len(msg.outputs)))
            firsts = (self.first_token_trace.rank_batch(msg.first_tokens, msg.sent_us)
                      if msg.first_tokens else ())
            self._dispatch(self.tracker.on_outputs(msg.rank, msg.outputs))
            if firsts:
                self.first_token_trace.delivered(firsts)
        elif isinstance(msg, RequestError):
            self._dispatch(self.tracker.on_error(msg.rank, msg.request_id, msg.message))
        elif isinstance(msg, StepFailed):
            self._dispatch(self.tracker.on_step_failed(msg.rank, msg.request_ids, msg.message))
        elif isinstance(msg, RankStats):
            self.metrics.rank_stats(msg.rank, msg.steps, msg.graph_captures, msg.graph_replays,
                                    msg.decode_replays, msg.decode_eager, msg.prefill_replays)
            if msg.experts_held >= 0:
                self.metrics.rank_experts_held.labels(str(msg.rank)).set(msg.experts_held)
        else:  # a (re)connected worker: it may make a healthy rank routable
            self._unreachable.discard(msg.rank)
            self._wake_membership.set()

    def _dispatch(self, sends: list[SendToRank]) -> None:
        """Send the tracker's commands; a rank we cannot reach loses its requests."""
        lost: set[int] = set()
        for send in sends:
            try:
                self.channel.send(send.rank, send.message)
                if type(send.message) is GenerateRequest:
                    self.first_token_trace.routed(send.message.request_id)
            except RankUnreachableError as exc:
                if isinstance(send.message, GenerateRequest):
                    logger.warning("epoch %s: %s; moving its requests",
                                   self._status.epoch, exc)
                    lost.add(send.rank)
            except LinkError as exc:  # closed channel during shutdown
                logger.warning("epoch %s: dropping %s for rank %d: %s",
                               self._status.epoch, type(send.message).__name__,
                               send.rank, exc)
        if lost:
            self._unreachable |= lost
            self._apply_status(self._status)

    def _record(self, events: list[Event]) -> None:
        """Observe the timeline's events in the metrics and append them to the event log."""
        for event in events:
            self.metrics.observe(event)
            if self.event_log is not None:
                self.event_log.write(event)

    def _on_interruption(self, seconds: float) -> None:
        self.metrics.interruption_seconds.observe(seconds)
