"""Which handler of the membership service answers which request type.

Each handler declares the message type it answers (and from which kind of connection)
with :func:`handles`; :func:`handler_table` collects them, bound to one service, so
there is no table of method names to keep in step with the methods.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from elasticep.enums import StrEnum

from . import messages as m


class Role(StrEnum):
    """The kind of peer at the other end of a control connection (after its hello)."""

    RANK = "rank"              # a worker process (`RankHello`)
    SUPERVISOR = "supervisor"  # a launcher, the front-end, `join` (`SupervisorHello`)


Handler = Callable[[Any, m.ControlMessage], "dict | None"]


def handles(msg_type: type[m.ControlMessage], role: Role | None = None) -> Callable:
    """Mark a method ``(self, peer, msg) -> reply fields or None`` as the handler of
    ``msg_type`` requests, accepted only from ``role`` connections (None: any)."""

    def mark(fn: Callable) -> Callable:
        fn.handles = (msg_type, role)
        return fn

    return mark


def handler_table(service: object) -> dict[type[m.ControlMessage], tuple[Handler, Role | None]]:
    """request type -> (the bound handler of ``service``, the role it must come from).

    Raises:
        ValueError: two methods handle one type.
    """
    table: dict[type[m.ControlMessage], tuple[Handler, Role | None]] = {}
    for name in dir(type(service)):
        marked = getattr(getattr(type(service), name), "handles", None)
        if marked is None:
            continue
        msg_type, role = marked
        if msg_type in table:
            raise ValueError(f"two handlers of {msg_type.TAG!r} messages")
        table[msg_type] = (getattr(service, name), role)
    return table


def dispatch(table: dict[type[m.ControlMessage], tuple[Handler, Role | None]], peer: Any,
             msg: m.ControlMessage) -> dict | None:
    """Run the handler of ``msg`` (a request other than hello and hb) for ``peer``.

    Raises:
        ProtocolError: the service takes no such message, or not from ``peer`` (a rank
            message on a supervisor connection, or before any hello).
    """
    entry = table.get(type(msg))
    if entry is None:
        raise m.ProtocolError(f"the coordinator takes no {msg.TAG!r} messages")
    handler, role = entry
    if role is not None and getattr(peer, "ROLE", None) != role:
        raise m.ProtocolError(f"a {msg.TAG!r} message must come from a {role} "
                              "connection (after its hello)")
    return handler(peer, msg)
