"""The wire form of control messages: their family base and the checked decoding.

The message base, the JSON form and the field checks are :mod:`elasticep.wire`'s (the
one convention of every internal boundary); this module makes the control messages one
family of it: each tagged class registers here, carries a request ``id`` (left off the
wire while None), and :func:`from_wire` takes any registered type. ``messages.py``
declares the types.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from elasticep import wire as _wire
from elasticep.wire.values import ProtocolError, convert, plain, register_codec

from .transitions import Decision

__all__ = ["ControlMessage", "ProtocolError", "convert", "decode_line", "from_wire",
           "message_types", "plain"]

_BY_TAG: dict[str, list[type[_wire.Message]]] = {}

# A decision's donors are keyed by op number: JSON keys are strings, so it has its own form.
register_codec(Decision, Decision.to_dict, Decision.from_dict)


@dataclass(frozen=True)
class ControlMessage(_wire.Message):
    """Base of every control message. ``id`` is set on requests that expect a Reply."""

    REGISTRY: ClassVar[dict[str, list[type[_wire.Message]]] | None] = _BY_TAG
    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"id"})

    id: int | None = field(default=None, kw_only=True)


def from_wire(d: Any) -> ControlMessage:
    """Turn one decoded JSON value into its control message.

    Raises:
        ProtocolError: not an object, no or an unknown ``"t"``, or a field missing,
            unknown or of the wrong type.
    """
    return _wire.decode(d, _BY_TAG, "control message")


def message_types() -> list[type[ControlMessage]]:
    """Every registered message class (one per wire type and variant)."""
    return [c for cs in _BY_TAG.values() for c in cs]


def decode_line(line: bytes) -> ControlMessage:
    """Parse one JSON line into its control message. Raises ProtocolError."""
    return _wire.decode_json(line, _BY_TAG, "control message")
