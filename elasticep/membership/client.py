"""`CoordinatorClient`: the supervisor's (launcher / front-end) view of the coordinator.

It needs no torch.distributed: one request/response connection.

    c = CoordinatorClient("127.0.0.1:29400")
    c.deployment_status()           # the /elastic_ep_status view (DeploymentStatus)
    c.scale(6)                      # change the target size
    c.status()                      # raw group records: epochs, per-slot states, pids
    c.report_death(2, pid=1234)     # the launcher's waitpid saw rank 2 exit
    c.request_admission([4, 5])     # ask ranks to admit ready slots at a step boundary
    c.request_deactivation([5])     # mark slot 5 draining; ranks remove it when ready
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

from . import messages as m
from .errors import (
    JoinRefusedError,
    MembershipRequestError,
    MembershipStoreError,
    OperationConflictError,
    OperationNotFoundError,
    ScaleInProgressError,
    ScaleRefusedError,
)
from .protocol import connect
from .status import DeploymentStatus

T = TypeVar("T")

_REFUSALS = {cls.code: cls for cls in (ScaleInProgressError, ScaleRefusedError,
                                       JoinRefusedError, OperationConflictError,
                                       OperationNotFoundError, m.ProtocolError)}


class CoordinatorClient:
    """Synchronous supervisor client. Every call has a timeout (seconds).

    Raises (all methods): MembershipRequestError (a ValueError) if the coordinator
    refuses, TimeoutError / ConnectionError if it is unreachable.
    """

    def __init__(self, address: str, timeout_s: float = 10.0) -> None:
        self.timeout_s = timeout_s
        self.conn = connect(address, timeout_s)
        self.conn.sock.settimeout(timeout_s)
        self._ids = itertools.count(1)
        # port of the coordinator's rendezvous TCPStore (on the coordinator's host)
        self.store_port: int = int(self._call(m.SupervisorHello())["store_port"])

    def _call(self, msg: m.ControlMessage) -> m.Reply:
        """Send ``msg`` and wait for its reply (ProtocolError if the answer is malformed)."""
        rid = next(self._ids)
        if not self.conn.send(replace(msg, id=rid)):
            raise ConnectionError("coordinator connection closed")
        while True:
            reply = self.conn.recv()
            if reply is None:
                raise ConnectionError("coordinator connection closed or timed out")
            if isinstance(reply, m.Reply) and reply.id == rid:
                break
        if not reply.ok:
            cls = _REFUSALS.get(reply.code, MembershipRequestError)
            raise cls(reply.error or "refused")
        return reply

    def status(self) -> dict:
        """Membership snapshot.

        Returns:
            {"max_world_size": int, "ranks": {"<rank>": {"pid": int, "alive": bool}},
             "groups": {name: {"epoch", "active", "states", "ranks", "on_failure",
                               "requests", "transition"}}}; WORLD is named "world".
        """
        r = self._call(m.GetStatus())
        return {k: r[k] for k in ("max_world_size", "ranks", "groups")}

    def report_death(self, rank: int, pid: int | None = None) -> None:
        """Declare global rank `rank` dead (e.g. waitpid returned). With `pid`, only if
        that pid still holds the slot, so a late report cannot kill a relaunched rank."""
        self._call(m.ReportDeath(rank, pid))

    def request_admission(self, ranks: list[int], group: str = "world") -> None:
        """Ask the members to admit these slots (visible via get_pending_requests)."""
        self._call(m.RequestAdmission(group, list(ranks)))

    def request_deactivation(self, ranks: list[int], group: str = "world") -> None:
        """Mark these slots draining and ask the members to remove them."""
        self._call(m.RequestDeactivation(group, list(ranks)))

    # ---- the deployment (see scaling.py) -----------------------------------------
    def publish_deployment(self, config_json: str, ep_size: int, max_ep_size: int,
                           min_holding_ranks: int = 1, scale_timeout_s: float = 600.0,
                           ) -> None:
        """Node 0: publish the settings every later rank and joiner reads, and the initial
        target size (kept if one is set already).

        Args:
            min_holding_ranks: the fewest healthy ranks whose expert slots hold every
                expert; a retirement that keeps fewer is refused (1: no limit known).
            scale_timeout_s: how long a grow waits for its joiners (seconds).
        """
        self._call(m.PublishDeployment(config_json, ep_size, max_ep_size, min_holding_ranks,
                                       scale_timeout_s))

    def deployment_config(self) -> str | None:
        """The published settings (JSON text), or None if nothing was published yet."""
        return self._call(m.GetDeploymentConfig())["config"]

    def deployment_status(self) -> DeploymentStatus:
        """The ``/elastic_ep_status`` view: target size, scale phase, each slot's state,
        pid and node.

        Raises:
            MembershipRequestError: no deployment was published yet.
        """
        return DeploymentStatus.from_dict(self._call(m.GetDeploymentStatus())["status"])

    def scale(self, new_ep_size: int, operation_id: str | None = None) -> dict[str, Any]:
        """Make ``new_ep_size`` the target: admit the joiners of the new slots, or drain
        the highest slots of the target. Returns at once.

        Args:
            operation_id: the operation's id (None: the coordinator makes one up); a
                repeat with the same id and size changes nothing.

        Returns:
            {"old_ep_size": int, "slots": [int], "scale_phase": str, "operation_id": str}
            (and "repeated": true for a repeat; "superseded": [str], the ids of the
            waiting grows it replaced).

        Raises:
            ScaleInProgressError: a scale is running; OperationConflictError: the id
            names another request; MembershipRequestError: out of range.
        """
        return self._operation_reply(self._call(m.Scale(int(new_ep_size), operation_id)))

    def retire(self, ranks: list[int] | None = None, node: int | None = None,
               operation_id: str | None = None, keep_processes: bool = False,
               ) -> dict[str, Any]:
        """Retire the slots ``ranks``, or every slot of ``node`` (give one): they drain
        (experts and requests move to the others), then leave; their workers exit, or
        stay up idle with ``keep_processes``. Returns at once.

        Returns:
            As :meth:`scale`.

        Raises:
            ScaleRefusedError: no healthy rank would be left, or too few to hold every
            expert; ScaleInProgressError, OperationConflictError,
            MembershipRequestError: as :meth:`scale`, or a slot not in the target.
        """
        return self._operation_reply(self._call(m.Retire(
            None if ranks is None else [int(r) for r in ranks], node, operation_id,
            bool(keep_processes))))

    def operation(self, operation_id: str) -> dict[str, Any]:
        """The operation's phase and per-slot states (``operations.op_view``).

        Raises:
            OperationNotFoundError: no operation has this id.
        """
        return dict(self._call(m.GetOperation(operation_id))["operation"])

    @staticmethod
    def _operation_reply(reply: m.Reply) -> dict[str, Any]:
        out = {k: reply[k] for k in ("old_ep_size", "slots", "scale_phase", "operation_id")}
        for k in ("superseded", "repeated"):  # present only when they say something
            if reply.body.get(k):
                out[k] = reply.body[k]
        return out

    def record_launch(self, rank: int, node: int, pid: int) -> None:
        """A launcher on ``node`` started worker ``pid`` for ``rank`` (it shows as joining
        until it registers). Dropped when this connection closes."""
        self._call(m.RecordLaunch(rank, pid, node=node))

    def clear_launch(self, rank: int, pid: int) -> None:
        """Worker ``pid`` of ``rank`` exited."""
        self._call(m.ClearLaunch(rank, pid))

    def reserve(self, ranks: list[int], mode: str) -> int:
        """Check that ``ranks`` may be joined in ``mode`` ("recover" or "scale") and claim
        them for this connection, all or none, until :meth:`release` or close.

        Returns:
            The target ``ep_size``.

        Raises:
            JoinRefusedError: a slot is occupied, out of range, or being joined.
        """
        who = f"elasticep join pid {os.getpid()} on {socket.gethostname()}"
        return int(self._call(m.Reserve(list(ranks), mode, who))["ep_size"])

    def release(self, ranks: list[int] | None = None) -> None:
        """Drop this connection's claims (of ``ranks``, or all)."""
        self._call(m.Release(None if ranks is None else list(ranks)))

    def close(self) -> None:
        self.conn.close()


class ReconnectingClient:
    """A :class:`CoordinatorClient` shared by threads, one request at a time, that
    reconnects after its connection broke or timed out (a restarted coordinator, a
    network partition that healed): a timed-out socket cannot be read again, so it is
    dropped and the next call connects afresh.

    With standby coordinators (``--membership-store etcd://...``) ``find_leader`` names
    the leader elected now, and each reconnect asks it first, so the client follows a
    leader change; ``on_connect`` then runs on each new connection (a launcher records
    its live workers with the new leader, who does not know them).

    Args:
        address: the coordinator's ``"host:port"`` (the first to try).
        timeout_s: bound of a connect and of each call (seconds).
        connect_now: connect in the constructor (raising as below) instead of lazily.
        find_leader: returns the elected coordinator's address (may raise
            ``MembershipStoreError`` or TimeoutError, as an unreachable one does).
        on_connect: called with each new client after its hello, before the request.

    Raises (constructor with ``connect_now``, and :meth:`call`):
        ConnectionError / TimeoutError / OSError: the coordinator is unreachable.
        ValueError: it refused the request (``MembershipRequestError``).
    """

    def __init__(self, address: str, timeout_s: float = 5.0, connect_now: bool = False,
                 find_leader: Callable[[], str] | None = None,
                 on_connect: Callable[[CoordinatorClient], None] | None = None) -> None:
        self.address, self.timeout_s = address, timeout_s
        self._find_leader, self._on_connect = find_leader, on_connect
        self._client: CoordinatorClient | None = None
        self._closed = False
        self._lock = threading.Lock()
        if connect_now:
            self._client = CoordinatorClient(address, timeout_s)

    def _connect(self) -> CoordinatorClient:
        if self._find_leader is not None:
            try:
                self.address = self._find_leader()
            except MembershipStoreError as e:  # etcd away: as unreachable as the leader
                raise ConnectionError(f"cannot find the coordinator: {e}") from e
        client = CoordinatorClient(self.address, self.timeout_s)
        if self._on_connect is not None:
            try:
                self._on_connect(client)
            except BaseException:
                client.close()
                raise
        return client

    def call(self, request: Callable[[CoordinatorClient], T]) -> T:
        """``request(client)`` on a (re)connected client, e.g.
        ``call(CoordinatorClient.deployment_status)`` or ``call(lambda c: c.scale(6))``."""
        with self._lock:
            if self._client is None:
                if self._closed:
                    raise ConnectionError(f"client of {self.address} was closed")
                self._client = self._connect()
            try:
                return request(self._client)
            except (ConnectionError, TimeoutError, OSError):
                self._client.close()
                self._client = None
                raise

    def close(self) -> None:
        """Close the connection; later calls raise ConnectionError."""
        with self._lock:
            self._closed = True
            if self._client is not None:
                self._client.close()
                self._client = None
