"""The front-end's :class:`MembershipSource` backed by the coordinator.

The coordinator knows slot states, pids and epochs; this adapter turns its snapshot into
the ``/elastic_ep_status`` shape and turns ``POST /scale_elastic_ep`` into admission or
deactivation requests. The *target* size (``ep_size``) lives here: the coordinator only
knows which slots are active, not which size the operator asked for.

Scale phases (derived, never stored elsewhere):

* ``waiting_for_joiners``: scale-up asked, some new slot has no ready joiner yet;
* ``admitting``: every new slot is ready or healthy, some are not admitted yet;
* ``draining``: scale-down asked, some leaving slot is still active;
* ``idle``: otherwise (a failed rank inside the target is degraded, not a scale).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from elasticep.distributed import CoordinatorClient
from elasticep.entrypoints.membership import ScaleInProgressError

logger = logging.getLogger(__name__)

WORLD = "world"
# the target size, for `elasticep join` (recover refuses slots >= it); same key as join_cmd's
TARGET_EP_SIZE_KEY = "elasticep/target_ep_size"


def scale_phase(states: list[str], up: set[int], down: set[int]) -> str:
    """The scale phase of a membership snapshot (pure).

    Args:
        states: slot state per slot (``membership.SLOT_STATES``).
        up: slots a scale-up is bringing in.
        down: slots a scale-down is taking out.
    """
    if any(states[s] not in ("ready", "healthy") for s in up):
        return "waiting_for_joiners"
    if any(states[s] != "healthy" for s in up):
        return "admitting"
    if any(states[s] in ("healthy", "draining") for s in down):
        return "draining"
    return "idle"


def status_from_snapshot(snap: dict[str, Any], ep_size: int, max_ep_size: int, phase: str,
                         node_of: Callable[[int], int],
                         launched_pid: Callable[[int], int | None] = lambda _r: None,
                         ) -> dict[str, Any]:
    """Turn ``CoordinatorClient.status()`` into the ``/elastic_ep_status`` shape (pure).

    Before the first worker registers there is no WORLD group yet: the first ``ep_size``
    slots are reported ``joining`` (they are loading) and the rest ``removed``. A slot
    that is ``failed``, ``removed`` or not registered yet, for which a launcher started a
    worker that has not registered (``launched_pid`` differs from the registered pid) or
    has registered its process but not its group slot yet (same pid, alive, in no
    group), is reported ``joining`` with the new pid: workers load their weights before they
    register, and the group lists a launch cohort as healthy from its first member on.
    """
    world = snap.get("groups", {}).get(WORLD)
    procs = snap.get("ranks", {})
    if world is None:
        states = ["joining"] * ep_size + ["removed"] * (max_ep_size - ep_size)
        epoch = 0
    else:
        states = list(world["states"])
        epoch = int(world["epoch"])
    ranks = []
    for slot, state in enumerate(states):
        rank = slot if world is None else int(world["ranks"][slot])
        proc = procs.get(str(rank))
        pid = None if proc is None else int(proc["pid"])
        if state in ("failed", "removed") or proc is None:  # None: never registered yet
            new_pid = launched_pid(rank)
            # A launched worker whose process registered but whose group slot did not
            # yet (alive, in no group) is joining too. A member being scaled away is
            # also alive in a removed slot, but it is in the group: it stays removed.
            registered_joiner = (proc is not None and new_pid == pid
                                 and bool(proc.get("alive", False))
                                 and WORLD not in proc.get("groups", ()))
            if new_pid is not None and (new_pid != pid or registered_joiner):
                state, pid = "joining", new_pid
        ranks.append({"rank": rank, "state": state, "pid": pid, "node": node_of(rank)})
    return {"epoch": epoch, "ep_size": ep_size, "max_ep_size": max_ep_size,
            "scale_phase": phase, "ranks": ranks}


class CoordinatorMembership:
    """:class:`MembershipSource` over a :class:`CoordinatorClient`.

    Thread-safe: the front-end calls ``status`` and ``scale`` from worker threads.

    Args:
        address: the coordinator's ``"host:port"``.
        ep_size: the initial target number of ranks.
        max_ep_size: capacity (slots ``[0, max_ep_size)``).
        node_of: rank -> node index, for the status (default: every rank on node 0).
        launched_pid: rank -> pid of a started worker that has not exited (see
            :func:`status_from_snapshot`); default: none known.
        timeout_s: bound of each coordinator call (seconds).
    """

    def __init__(self, address: str, ep_size: int, max_ep_size: int,
                 node_of: Callable[[int], int] | None = None,
                 launched_pid: Callable[[int], int | None] | None = None,
                 timeout_s: float = 5.0) -> None:
        self._address = address
        self._timeout_s = timeout_s
        self._client: CoordinatorClient | None = None
        self._lock = threading.Lock()
        self.ep_size = ep_size
        self.max_ep_size = max_ep_size
        self._node_of = node_of or (lambda _rank: 0)
        self._launched_pid = launched_pid or (lambda _rank: None)
        self._up: set[int] = set()
        self._down: set[int] = set()
        self._store: Any = None  # client of the coordinator's store, opened on first scale

    # ---- coordinator access --------------------------------------------------------
    def _call(self, fn: Callable[[CoordinatorClient], Any]) -> Any:
        """Run ``fn`` on a (re)connected client; the connection is rebuilt after errors.

        Raises:
            ConnectionError / TimeoutError: the coordinator is unreachable.
            ValueError: the coordinator refused the request.
        """
        if self._client is None:
            self._client = CoordinatorClient(self._address, self._timeout_s)
        try:
            return fn(self._client)
        except (ConnectionError, TimeoutError, OSError):
            self._client.close()
            self._client = None
            raise

    def snapshot(self) -> dict[str, Any]:
        """The coordinator's raw status (see ``CoordinatorClient.status``)."""
        with self._lock:
            return self._call(lambda c: c.status())

    def _states(self, snap: dict[str, Any]) -> list[str]:
        world = snap.get("groups", {}).get(WORLD)
        if world is None:
            return ["joining"] * self.ep_size + ["removed"] * (self.max_ep_size - self.ep_size)
        return list(world["states"])

    def _phase(self, states: list[str]) -> str:
        phase = scale_phase(states, self._up, self._down)
        if phase == "idle" and (self._up or self._down):
            logger.info("scale to ep_size %d finished", self.ep_size)
            self._up, self._down = set(), set()
        return phase

    # ---- MembershipSource ----------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """The ``/elastic_ep_status`` body (without ``running_requests``).

        Raises:
            ConnectionError / TimeoutError: the coordinator is unreachable.
        """
        with self._lock:
            snap = self._call(lambda c: c.status())
            phase = self._phase(self._states(snap))
            return status_from_snapshot(snap, self.ep_size, self.max_ep_size, phase,
                                        self._node_of, self._launched_pid)

    def scale(self, new_ep_size: int) -> dict[str, Any]:
        """Grow to ``new_ep_size`` (admit joiners of slots ``[ep_size, new)``) or shrink
        (drain and remove the highest active slots). Returns at once.

        While a grow still waits for joiners, a smaller target that is not below the
        size before the grow withdraws the slots above it that are not admitted yet
        (a joiner that died need not be replaced to finish the scale).

        Raises:
            ScaleInProgressError: a scale is still running (and this is not such a
                withdrawal).
            ValueError: ``new_ep_size`` outside ``[1, max_ep_size]``.
            ConnectionError / TimeoutError: the coordinator is unreachable.
        """
        if not 1 <= new_ep_size <= self.max_ep_size:
            raise ValueError(f"new_ep_size must be in [1, {self.max_ep_size}], "
                             f"got {new_ep_size}")
        with self._lock:
            snap = self._call(lambda c: c.status())
            states = self._states(snap)
            phase = self._phase(states)
            if phase == "waiting_for_joiners" and min(self._up) <= new_ep_size < self.ep_size:
                return self._withdraw(new_ep_size, states, snap)
            if phase != "idle":
                raise ScaleInProgressError(
                    f"a scale to ep_size {self.ep_size} is in progress ({phase})")
            old = self.ep_size
            if new_ep_size > old:
                slots = list(range(old, new_ep_size))
                self._call(lambda c: c.request_admission(slots))
                self._up = set(slots)
            elif new_ep_size < old:
                slots = [s for s in range(new_ep_size, self.max_ep_size)
                         if states[s] in ("healthy", "draining")]
                if slots:
                    self._call(lambda c: c.request_deactivation(slots))
                self._down = set(slots)
            else:
                slots = []
            self.ep_size = new_ep_size
            self._publish_target()
            epoch = snap.get("groups", {}).get(WORLD, {}).get("epoch", 0)
            logger.info("epoch %s: scale ep_size %d -> %d, slots %s", epoch, old,
                        new_ep_size, slots)
            return {"old_ep_size": old, "slots": slots,
                    "scale_phase": scale_phase(states, self._up, self._down)}

    def _withdraw(self, new_ep_size: int, states: list[str], snap: dict[str, Any]
                  ) -> dict[str, Any]:
        """Lower a pending grow's target (lock held); see :meth:`scale`."""
        slots = sorted(s for s in self._up if s >= new_ep_size)
        if any(states[s] == "healthy" for s in slots):
            raise ScaleInProgressError(
                f"ranks {[s for s in slots if states[s] == 'healthy']} are already admitted; "
                f"wait for the scale to ep_size {self.ep_size}, then scale down")
        self._call(lambda c: c.request_deactivation(slots))  # withdraws their admission
        old, self.ep_size = self.ep_size, new_ep_size
        self._up -= set(slots)
        self._publish_target()
        logger.info("epoch %s: pending scale to ep_size %d lowered to %d, slots %s withdrawn",
                    snap.get("groups", {}).get(WORLD, {}).get("epoch", 0), old, new_ep_size,
                    slots)
        return {"old_ep_size": old, "slots": slots,
                "scale_phase": scale_phase(states, self._up, self._down)}

    def _publish_target(self) -> None:
        """Write the target size to the coordinator's store (best effort)."""
        if not isinstance(getattr(self._client, "store_port", None), int):
            return  # a stand-in client (tests)
        try:
            if self._store is None:
                from elasticep.entrypoints.launcher import open_store  # torch: only now

                self._store = open_store(self._address, self._timeout_s)
            self._store.set(TARGET_EP_SIZE_KEY, str(self.ep_size))
        except (RuntimeError, OSError) as exc:
            self._store = None
            logger.warning("could not publish the target ep_size %d: %s", self.ep_size, exc)

    def close(self) -> None:
        """Close the coordinator connection."""
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None
