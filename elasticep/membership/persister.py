"""Write-behind of the coordinator's durable state to its store (``--membership-store``).

The coordinator calls :meth:`StatePersister.changed` after each event it handled; a
thread of its own takes the newest :class:`MembershipState` and commits it, fenced on
the revision it last committed or read. The network round trip never runs under the
coordinator's lock, so a slow or unreachable etcd cannot starve heartbeats: serving
goes on with the membership in memory, and :meth:`health` says what is wrong until a
commit goes through again.

A :class:`FencedCommitError` means another coordinator committed since: this one is
deposed and stops committing for good (its health says so).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from .durable_state import MembershipState
from .errors import FencedCommitError, MembershipStoreError
from .store import MembershipStore

log = logging.getLogger("elasticep.membership")

RETRY_S = 0.5  # between commits while the store does not answer


@dataclass(frozen=True)
class StoreHealth:
    """What ``/health`` and the status say about the store.

    Attributes:
        ok: the newest state is committed (or being committed with no error so far).
        reason: why not, in one line (None when ok).
        revision: the store revision of the last commit this coordinator made or read.
        deposed: another coordinator committed; this one commits no more.
    """

    ok: bool
    reason: str | None
    revision: int
    deposed: bool = False


class StatePersister:
    """Commits ``snapshot()`` to ``store`` whenever it changed; see the module docstring.

    Args:
        store: where the state goes (claimed by the caller already).
        snapshot: returns the current durable state; called on the persister's thread,
            so it must take the coordinator's lock itself.
        revision: the revision the caller last read (``store.load()[1]``).
        on_committed: called on the persister's thread with each state the store is
            known to hold from now on (after a commit, or an adopted late write).
        on_fenced: called once on the persister's thread, with the reason, when a
            commit is fenced (another coordinator committed): nothing commits from then.
    """

    def __init__(self, store: MembershipStore, snapshot: Callable[[], MembershipState],
                 revision: int,
                 on_committed: Callable[[MembershipState], None] | None = None,
                 on_fenced: Callable[[str], None] | None = None) -> None:
        self._store = store
        self._snapshot = snapshot
        self._on_committed = on_committed
        self._on_fenced = on_fenced
        self._revision = revision
        self._committed: MembershipState | None = None
        # states sent since the last confirmed commit: a commit that timed out may still
        # be applied (a lone member logged it and commits it once quorum is back)
        self._unconfirmed: list[MembershipState] = []
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._health = StoreHealth(True, None, revision)
        self._idle = threading.Condition()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="coord-state-persister")
        self._thread.start()
        self.changed()

    def changed(self) -> None:
        """The state may have changed: commit it soon (cheap; call after every event)."""
        self._wake.set()

    def health(self) -> StoreHealth:
        return self._health

    def wait_committed(self, timeout_s: float) -> bool:
        """Block until the state as of now is committed (tests, clean shutdown).
        Returns False if it was not within ``timeout_s`` seconds."""
        target = self._snapshot()
        with self._idle:
            return self._idle.wait_for(lambda: self._committed == target
                                       or self._health.deposed, timeout_s)

    def close(self) -> None:
        self._closed.set()
        self._wake.set()
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._closed.is_set():
            self._wake.wait()
            self._wake.clear()
            if self._closed.is_set() or self._health.deposed:
                return
            state = self._snapshot()
            if state == self._committed:
                if not self._health.ok:  # a late write of ours was found to be it
                    self._set(StoreHealth(True, None, self._revision))
                if self._on_committed is not None:  # unchanged since: held too
                    self._on_committed(state)
                continue
            self._unconfirmed.append(state)
            try:
                self._revision = self._store.commit(state, self._revision)
            except FencedCommitError as e:
                if self._adopt_own_write():
                    self._wake.set()  # our own late write moved the revision: go on
                    continue
                log.error("coordinator: %s; committing no more", e)
                self._set(StoreHealth(False, str(e), self._revision, deposed=True))
                if self._on_fenced is not None:
                    self._on_fenced(str(e))
                return
            except MembershipStoreError as e:
                if self._health.ok:
                    log.warning("coordinator: membership store: %s (serving goes on; "
                                "retrying every %.1f s)", e, RETRY_S)
                self._set(StoreHealth(False, f"membership store unavailable: {e}",
                                      self._revision))
                self._adopt_own_write()
                self._wake.set()
                self._closed.wait(RETRY_S)
                continue
            self._unconfirmed.clear()
            if not self._health.ok:
                log.info("coordinator: membership store answers again (revision %d)",
                         self._revision)
            self._committed = state
            self._set(StoreHealth(True, None, self._revision))
            if self._on_committed is not None:
                self._on_committed(state)

    def _adopt_own_write(self) -> bool:
        """After a commit of unknown outcome, or a fenced one: read what is there. If it
        is a state this coordinator sent since its last confirmed commit, that write went
        through late: the next commit names its revision (returns True). Anything else
        at a newer revision is another coordinator's, and the next commit is fenced."""
        try:
            stored, rev = self._store.load()
        except MembershipStoreError:
            return False
        if rev == self._revision or stored is None or stored not in self._unconfirmed:
            return False
        log.info("coordinator: a commit of unknown outcome went through (revision %d)", rev)
        self._revision, self._committed = rev, stored
        self._unconfirmed.clear()
        if self._on_committed is not None:
            self._on_committed(stored)
        return True

    def _set(self, health: StoreHealth) -> None:
        with self._idle:
            self._health = health
            self._idle.notify_all()
