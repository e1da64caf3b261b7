"""The wire form of control messages: the `Message` base and the checked decoding.

A message is one JSON object: ``"t"`` names its type (the class's ``TAG``) and every
other key is a field of the class, under the same name; ``messages.py`` declares the
types.

:func:`from_wire` checks every field against the class's annotation (the fields drive
it; no per-type code), so an unknown type, a missing or extra field or a value of the
wrong type is one :class:`ProtocolError` line instead of a ``KeyError`` deep in a
handler.
"""

from __future__ import annotations

import enum
import functools
import json
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar

from .transitions import Decision


class ProtocolError(ValueError):
    """A control message that is not JSON, has an unknown type, or a missing, extra or
    mistyped field.

    Attributes:
        rid: the message's request id, when one could be read (so the sender can be
            answered instead of waiting for its timeout).
    """

    code = "malformed"  # the refusal code its Reply carries

    def __init__(self, reason: str, rid: int | None = None) -> None:
        super().__init__(reason)
        self.rid = rid


_BY_TAG: dict[str, list[type[Message]]] = {}


@dataclass(frozen=True)
class Message:
    """Base of every control message. ``id`` is set on requests that expect a Reply."""

    TAG: ClassVar[str] = ""
    # wire keys that tell apart the classes sharing one TAG (hello: rank or supervisor)
    MATCH: ClassVar[tuple[tuple[str, Any], ...]] = ()

    id: int | None = field(default=None, kw_only=True)

    def __init_subclass__(cls, tag: str | None = None, **kwargs: Any) -> None:
        # ``class Ping(Message, tag="ping")`` registers the type under its wire name;
        # the untagged classes below only share fields
        super().__init_subclass__(**kwargs)
        if tag is not None:
            cls.TAG = tag
            _BY_TAG.setdefault(tag, []).append(cls)

    def to_wire(self) -> dict[str, Any]:
        """The JSON object of this message (``"t"`` first; no ``"id"`` when None)."""
        out: dict[str, Any] = {"t": self.TAG}
        for f in fields(self):
            value = getattr(self, f.name)
            if not (f.name == "id" and value is None):
                out[f.name] = plain(value)
        return out

    @classmethod
    def _from_fields(cls, d: dict[str, Any]) -> Message:
        hints = _hints(cls)
        names = {f.name for f in fields(cls)}
        extra = sorted(set(d) - names - {"t"})
        if extra:
            raise ProtocolError(f"{cls.TAG!r} message has unknown field(s) {extra}", _rid(d))
        kw = {}
        for f in fields(cls):
            if f.name in d:
                kw[f.name] = convert(d[f.name], hints[f.name], f"{cls.TAG}.{f.name}", d)
            elif not _has_default(f):
                raise ProtocolError(f"{cls.TAG!r} message lacks field {f.name!r}", _rid(d))
        return cls(**kw)


def from_wire(d: Any) -> Message:
    """Turn one decoded JSON value into its message.

    Raises:
        ProtocolError: not an object, no or an unknown ``"t"``, or a field missing,
            unknown or of the wrong type.
    """
    if not isinstance(d, dict):
        raise ProtocolError(f"control message must be a JSON object, got {type(d).__name__}")
    tag = d.get("t")
    classes = _BY_TAG.get(tag) if isinstance(tag, str) else None
    if not classes:
        raise ProtocolError(f"unknown control message type {tag!r}", _rid(d))
    for cls in sorted(classes, key=lambda c: not c.MATCH):
        if all(d.get(k) == v for k, v in cls.MATCH):
            return cls._from_fields(d)
    raise ProtocolError(f"no variant of {tag!r} matches {sorted(d)}", _rid(d))


def message_types() -> list[type[Message]]:
    """Every registered message class (one per wire type and variant)."""
    return [c for cs in _BY_TAG.values() for c in cs]


def decode_line(line: bytes) -> Message:
    """Parse one JSON line into its message. Raises ProtocolError."""
    try:
        d = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"control message is not JSON: {line[:60]!r} ({e})") from None
    return from_wire(d)


# ---------------------------------------------------------------------- field handling
def _rid(d: dict) -> int | None:
    rid = d.get("id")
    return rid if isinstance(rid, int) and not isinstance(rid, bool) else None


def _has_default(f) -> bool:
    return f.default is not MISSING or f.default_factory is not MISSING


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def plain(value: Any) -> Any:
    """A field's value as JSON-ready data (enums as their values, Decision as its dict)."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Decision):
        return value.to_dict()
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


def convert(value: Any, hint: Any, where: str, msg: dict) -> Any:
    """``value`` as read from JSON, checked against (and turned into) type ``hint``.

    Args:
        where: names the value in the error (``"tag.field"``); msg: the whole message,
            for its request id.
    Raises:
        ProtocolError: ``value`` is not of type ``hint``.
    """
    origin = typing.get_origin(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        for h in typing.get_args(hint):
            try:
                return convert(value, h, where, msg)
            except ProtocolError:
                pass
    elif hint is type(None):
        if value is None:
            return None
    elif origin is list:
        if isinstance(value, list):
            (item,) = typing.get_args(hint)
            return [convert(v, item, where, msg) for v in value]
    elif origin is dict:
        if isinstance(value, dict):
            _key, item = typing.get_args(hint)
            return {k: convert(v, item, where, msg) for k, v in value.items()}
    elif isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(value)
        except ValueError:
            pass
    elif hint is Decision:
        try:
            return Decision.from_dict(value)
        except (KeyError, TypeError, ValueError, AttributeError):
            pass
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(value, hint):
        return value
    name = getattr(hint, "__name__", None) or str(hint)
    raise ProtocolError(f"{where}: expected {name}, got {json.dumps(value)[:60]}", _rid(msg))
