"""A client of the rendezvous TCPStore that moves to each new coordinator leader.

With standby coordinators (``--membership-store etcd://...``) every leader runs its own
rendezvous TCPStore, empty when it takes over. The elastic groups move their store
clients at a leader change themselves (``api.py``); a side channel that keeps keys of
its own in the store (the same-host exchange's CUDA IPC handles, the peer expert
weights' handles) uses a :class:`LeaderStore`: after a leader change its next call
first connects to the new leader's store and puts there again what this process
published (the ``republish`` callbacks), so that peers, and ranks that join later,
find it.

    store = LeaderStore(lambda: dist.PrefixStore("x", store_client()))
    add_leader_listener(store.follow)        # the control thread marks it stale
    store.republish.append(buffers.republish)
    store.add(key, 0); store.set(key, b"..."); store.get(key)

The move happens on the calling thread, at its next call or :meth:`LeaderStore.catch_up`
(the step loop calls :meth:`LeaderStore.try_catch_up` every step), never on the control thread, so one thread uses
the store and republishes at a time, and a publish never races its own republish.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

log = logging.getLogger(__name__)


class LeaderStore:
    """The subset of ``torch.distributed.Store`` that the side channels use (``add``,
    ``set``, ``get``), over the current leader's store; see the module docstring.

    Args:
        connect: returns a fresh client of the current leader's store (raises
            ``RuntimeError`` / ``OSError`` if it cannot be reached).

    Attributes:
        republish: called with the new store after each move, in order, each putting
            again what its owner last published (its generation and handle).
        moves: how many times it moved to a new leader's store.
    """

    def __init__(self, connect: Callable[[], dist.Store]) -> None:
        self._connect = connect
        self._client = connect()
        self._stale = False
        self.republish: list[Callable[[dist.Store], None]] = []
        self.moves = 0

    def follow(self) -> None:
        """The coordinator leader changed (any thread): move at the next call."""
        self._stale = True

    def catch_up(self) -> bool:
        """If the leader changed, connect to its store and republish there now.

        Returns:
            True if it moved now.

        Raises:
            RuntimeError / OSError: the new leader's store did not answer (it stays
                marked, and the next call tries again).
        """
        if not self._stale:
            return False
        self._stale = False
        try:
            client = self._connect()
            for put in self.republish:
                put(client)
        except BaseException:
            self._stale = True
            raise
        self._client = client
        self.moves += 1
        log.info("rendezvous store: moved to the new coordinator leader's store and "
                 "republished %d entries", len(self.republish))
        return True

    def try_catch_up(self) -> bool:
        """:meth:`catch_up`, but a store that does not answer is logged, not raised
        (tried again at the next call). Returns True if it moved now."""
        try:
            return self.catch_up()
        except (RuntimeError, OSError) as exc:
            log.warning("the new coordinator leader's rendezvous store: %s", exc)
            return False

    def _call(self, op: Callable[[dist.Store], Any]) -> Any:
        self.catch_up()
        try:
            return op(self._client)
        except RuntimeError:
            # the leader died under the call and the control connection has already
            # found its successor: do it once more on the successor's store
            if not self._stale:
                raise
            self.catch_up()
            return op(self._client)

    def add(self, key: str, amount: int) -> int:
        """``Store.add`` on the current leader's store."""
        return self._call(lambda c: c.add(key, amount))

    def set(self, key: str, value: str | bytes) -> None:
        """``Store.set`` on the current leader's store."""
        self._call(lambda c: c.set(key, value))

    def get(self, key: str) -> bytes:
        """``Store.get`` on the current leader's store (waits for the key up to the
        client's timeout)."""
        return self._call(lambda c: c.get(key))
