"""A background poller of the coordinator's WORLD membership: when did each epoch and
slot state appear.

It talks to the coordinator directly (as a supervisor, read only), so its timestamps do
not depend on the HTTP front-end being responsive during a failover. With standby
coordinators (``--membership-store etcd://...``) it follows the leader: each reconnect
asks ``find_leader`` where the coordinator is now.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from elasticep.membership import CoordinatorClient

WORLD = "world"


@dataclass(frozen=True)
class Snapshot:
    """The WORLD group at one poll.

    Attributes:
        t: when it was seen (monotonic seconds).
        epoch: membership epoch.
        active: active slots, sorted.
        states: state per slot.
    """

    t: float
    epoch: int
    active: tuple[int, ...]
    states: tuple[str, ...]


class StatusWatch:
    """Poll the coordinator every ``poll_s`` seconds; keep each distinct snapshot.

    Args:
        coordinator: ``"host:port"``.
        poll_s: poll interval in seconds.
        timeout_s: bound of each coordinator call (a failed call is retried next poll).
        find_leader: where the coordinator is now (``"host:port"``, or None while none
            leads), asked before each connection; default: always ``coordinator``.
    """

    def __init__(self, coordinator: str, poll_s: float = 0.05, timeout_s: float = 2.0,
                 find_leader: Callable[[], str | None] | None = None) -> None:
        self.history: list[Snapshot] = []
        self.errors = 0
        self._poll_s, self._timeout_s = poll_s, timeout_s
        self._find_leader = find_leader or (lambda: coordinator)
        self._stop = threading.Event()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="status-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        client: CoordinatorClient | None = None
        while not self._stop.is_set():
            try:
                if client is None:
                    address = self._find_leader()
                    if address is None:
                        raise ConnectionError("no coordinator leads")
                    client = CoordinatorClient(address, self._timeout_s)
                world = client.status()["groups"].get(WORLD)
            except (ConnectionError, TimeoutError, OSError, ValueError):
                self.errors += 1
                if client is not None:
                    client.close()
                client = None
                world = None
            if world is not None:
                snap = Snapshot(time.monotonic(), int(world["epoch"]),
                                tuple(sorted(world["active"])), tuple(world["states"]))
                with self._cond:
                    last = self.history[-1] if self.history else None
                    if last is None or (last.epoch, last.states) != (snap.epoch, snap.states):
                        self.history.append(snap)
                        self._cond.notify_all()
            self._stop.wait(self._poll_s)
        if client is not None:
            client.close()

    def latest(self) -> Snapshot | None:
        """The most recent distinct snapshot."""
        with self._cond:
            return self.history[-1] if self.history else None

    def wait_for(self, pred: Callable[[Snapshot], bool], timeout_s: float, what: str,
                 after: float = 0.0) -> Snapshot:
        """The first snapshot seen at or after ``after`` that satisfies ``pred``.

        Raises:
            TimeoutError: none within ``timeout_s`` seconds (message names ``what``).
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for snap in self.history:
                    if snap.t >= after and pred(snap):
                        return snap
                left = deadline - time.monotonic()
                if left <= 0:
                    last = self.history[-1] if self.history else None
                    raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}; "
                                       f"last membership: {last}")
                self._cond.wait(min(left, 0.5))

    def stop(self) -> None:
        """Stop polling (bounded by one coordinator call)."""
        self._stop.set()
        self._thread.join(self._timeout_s + 1.0)
