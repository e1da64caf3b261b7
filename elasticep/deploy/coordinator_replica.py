"""This node's coordinator replica under ``--membership-store etcd://...``: one
:class:`~elasticep.membership.process.CoordinatorProcess` at a time, replaced by a
fresh standby whenever it dies, so that no node's death or coordinator crash leaves the
deployment without a candidate for the leader lease.

    replica = CoordinatorReplica.standby("10.0.0.2", store_url, hb_timeout_s=3.0)
    replica.current.pid, replica.current.leads
    replica.begin_stop(); replica.close()

Node 0 starts its first replica as the leader (:meth:`CoordinatorReplica.leader`: it
claims the prefix and must win); every other node, and every replacement, is a standby
that campaigns until elected. The ranks, launchers and front-end find whichever leads
through etcd (``find_coordinator``), so a replacement needs no one to be told of it.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

from elasticep.membership.process import CoordinatorProcess
from elasticep.membership.protocol import parse_address

logger = logging.getLogger(__name__)

RESTART_PAUSE_S = 0.5  # between a replica's death and its replacement (no busy loop)


def local_address_towards(address: str) -> str:
    """This host's address on the route to ``address`` (``"host:port"``): where a
    replica binds so that the node that reached it can reach it back (no packet is
    sent: a UDP connect only picks the route).

    Raises:
        OSError: no route.
    """
    host, port = parse_address(address)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


class CoordinatorReplica:
    """See the module docstring. Use :meth:`standby` or :meth:`leader`.

    Args:
        host: the interface its control endpoint binds (reachable by the other nodes).
        membership_store: the ``etcd://...`` URL.
        hb_interval_s, hb_timeout_s: as for ``CoordinatorProcess.start`` (seconds).
    """

    def __init__(self, host: str, membership_store: str, hb_interval_s: float,
                 hb_timeout_s: float) -> None:
        self.host, self.url = host, membership_store
        self.hb_interval_s, self.hb_timeout_s = hb_interval_s, hb_timeout_s
        self.current: CoordinatorProcess | None = None
        self.replaced = 0  # replicas started after one died
        self._closed = False
        self._lock = threading.Lock()

    @classmethod
    def standby(cls, host: str, membership_store: str, hb_interval_s: float = 0.2,
                hb_timeout_s: float = 2.0) -> CoordinatorReplica:
        """Start a standby replica on this node (returns at once).

        Raises:
            OSError: ``host`` cannot be bound.
        """
        r = cls(host, membership_store, hb_interval_s, hb_timeout_s)
        r.current = r._spawn()
        return r

    @classmethod
    def leader(cls, host: str, port: int, membership_store: str, deployment_id: str,
               hb_interval_s: float = 0.2, hb_timeout_s: float = 2.0) -> CoordinatorReplica:
        """Node 0 at start: a replica that claims the prefix for ``deployment_id`` and
        leads (waits until it serves at ``host:port``, as ``CoordinatorProcess.start``).

        Raises:
            OSError / TimeoutError: as ``CoordinatorProcess.start``.
        """
        r = cls(host, membership_store, hb_interval_s, hb_timeout_s)
        r.current = CoordinatorProcess.start(
            host, port, hb_interval_s=hb_interval_s, hb_timeout_s=hb_timeout_s,
            on_exit=r.replace, membership_store=membership_store,
            deployment_id=deployment_id)
        return r

    def _spawn(self) -> CoordinatorProcess:
        return CoordinatorProcess.start(
            self.host, 0, hb_interval_s=self.hb_interval_s, hb_timeout_s=self.hb_timeout_s,
            on_exit=self.replace, membership_store=self.url, standby=True)

    def replace(self, code: int) -> None:
        """The current replica exited with ``code`` (its watcher thread): start a fresh
        standby unless closing."""
        with self._lock:
            if self._closed:
                return
            dead = self.current
            logger.warning("coordinator replica pid %s exited with %d; starting a standby",
                           None if dead is None else dead.pid, code)
        time.sleep(RESTART_PAUSE_S)
        with self._lock:
            if self._closed:
                return
            try:
                self.current = self._spawn()
                self.replaced += 1
            except OSError as exc:
                logger.error("could not start a standby coordinator replica: %s", exc)

    @property
    def pid(self) -> int | None:
        """The current replica's pid."""
        return None if self.current is None else self.current.pid

    @property
    def address(self) -> str | None:
        """The current replica's control endpoint."""
        return None if self.current is None else self.current.address

    @property
    def store_port(self) -> int | None:
        """The current replica's rendezvous store port (None while a standby)."""
        return None if self.current is None else self.current.store_port

    def begin_stop(self) -> bool:
        """As ``CoordinatorProcess.begin_stop`` on the current replica (False if it does
        not lead: the leader elsewhere is not told)."""
        cur = self.current
        return cur is not None and cur.begin_stop()

    def close(self) -> None:
        """Stop the current replica and start no other; idempotent."""
        with self._lock:
            self._closed = True
            cur = self.current
        if cur is not None:
            cur.close()
