"""Hold each epoch commit until the membership store has the state that contains it.

With a durable store (``--membership-store etcd://...``) the coordinator's state is
written behind (:mod:`.persister`), but an epoch must not reach the ranks before the
store has it: a leader cut off from the store's majority would otherwise go on
committing epochs that its successor, elected on the other side, never sees, and two
groups of ranks could then run different active sets under one epoch number. So a
``Commit`` waits here until the persister confirms a state taken after it, and a
deposed leader's held commits are never sent.

Order on each connection is kept: once a connection has a held message, everything
after it waits behind it (an ``Announce`` of the next epoch must not overtake the
commit of this one). Heartbeat acknowledgements pass at once, since they carry no
state and a rank that hears nothing for its stall timeout would give the coordinator
up: while the store is unreachable, serving goes on with the committed membership and
no change commits. The gate is pure: the caller numbers the changes and says which
number the store has confirmed.

The decisions themselves wait here too (:meth:`CommitGate.decided`), with or without a
member to send them to, so that the coordinator logs an epoch as committed only once
the store has it, and a deposed or closing leader can name the decisions that never
went out (:meth:`CommitGate.refuse`).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from . import messages as m
from .service import SendOnConn


class CommitGate:
    """Which of the service's sends may go now (see the module docstring)."""

    def __init__(self) -> None:
        # conn -> [(change number the send waits for, send)], in send order
        self._held: dict[int, deque[tuple[int, SendOnConn]]] = {}
        self.durable = 0  # the newest change number the store has confirmed
        # (change number, decision) decided but not confirmed yet, in decision order
        self._decisions: deque[tuple[int, Any]] = deque()
        self._released: list[Any] = []  # confirmed since the last take_committed()

    def decided(self, decision: Any, change: int) -> bool:
        """An epoch decision made by the event numbered ``change``. Returns True if the
        store already has that change (it is committed now); else it is held until
        :meth:`confirm` releases it (:meth:`take_committed`)."""
        if change <= self.durable and not self._decisions:
            return True
        self._decisions.append((change, decision))
        return False

    def take_committed(self) -> list[Any]:
        """The decisions :meth:`confirm` released since the last call, in order."""
        out, self._released = self._released, []
        return out

    def refuse(self) -> list[Any]:
        """The coordinator commits no more (deposed, or closing): the decisions still
        held, in order, which no member will ever receive."""
        out = [d for _c, d in self._decisions]
        self._decisions.clear()
        return out

    def route(self, sends: list[SendOnConn], change: int) -> list[SendOnConn]:
        """The sends of the event numbered ``change`` that may go now, in order; the
        rest are held (a ``Commit``, and whatever follows a held send on its
        connection)."""
        out = []
        for s in sends:
            queue = self._held.get(s.conn)
            if isinstance(s.msg, m.HeartbeatAck) and not s.close:
                out.append(s)
            elif queue:
                queue.append((change, s))
            elif isinstance(s.msg, m.Commit) and change > self.durable:
                self._held[s.conn] = deque([(change, s)])
            else:
                out.append(s)
        return out

    def confirm(self, change: int) -> list[SendOnConn]:
        """The store has every change up to ``change``: the held sends that may go now,
        in order per connection."""
        self.durable = max(self.durable, change)
        while self._decisions and self._decisions[0][0] <= self.durable:
            self._released.append(self._decisions.popleft()[1])
        out = []
        for conn in list(self._held):
            queue = self._held[conn]
            while queue and (queue[0][0] <= self.durable
                             or not isinstance(queue[0][1].msg, m.Commit)):
                out.append(queue.popleft()[1])
            if not queue:
                del self._held[conn]
        return out

    def drop(self, conn: int) -> None:
        """``conn`` closed: what was held for it goes nowhere."""
        self._held.pop(conn, None)

    def held(self) -> int:
        """How many sends wait (for the status and tests)."""
        return sum(len(q) for q in self._held.values())
