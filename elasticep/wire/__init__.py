"""The one wire convention of elasticep's internal boundaries: the `Message` base and
its checked decoding.

A message is a frozen dataclass sent as one JSON object: ``"t"`` names its type (the
class's ``TAG``) and every other key is a field of the class, under the same name. Field
values may be ints, floats, strs, bools, None, enums (sent as their values), lists,
tuples (``tuple[X, ...]``, or of fixed length such as ``tuple[int, float]``; sent as
lists), dicts with str keys, nested dataclasses (sent as objects of their fields) and
the types given a codec with :func:`~elasticep.wire.values.register_codec`
(:mod:`elasticep.wire.values` holds the conversion of values).

Decoding checks every field against the class's annotation (the fields drive it; no
per-type code), so an unknown type, a missing or extra field or a value of the wrong
type is one :class:`ProtocolError` line instead of a ``KeyError`` deep in a handler.
The check of each annotation is compiled once into a small function
(:func:`~elasticep.wire.values.converter`), so decoding a message costs a few calls per field: the worker sends its tokens with it
every step.

Who uses it: the control messages (``membership/messages.py``: a family with its own
registry of tags and a request ``id``) and the front-end/worker link
(``frontend_link/messages.py`` and the request messages of ``engine/request.py``), and
the configs a worker is started with or a node fetches (``config.py``). It imports only
the standard library, so every layer may, ``config`` included.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

from elasticep.wire.values import ProtocolError, field_encoders, message_spec, request_id


class Message:
    """Base of every message. A subclass is a frozen dataclass; ``tag=`` names its type.

    Class attributes:
        TAG: the wire name of the type (``"t"``).
        MATCH: wire keys that tell apart the classes sharing one TAG.
        REGISTRY: where tagged subclasses register themselves (a family base sets its
            own dict; None: no registry, the receiver names the classes it takes).
        OMIT_NONE: fields left off the wire while None (a request's ``id``).
    """

    TAG: ClassVar[str] = ""
    MATCH: ClassVar[tuple[tuple[str, Any], ...]] = ()
    REGISTRY: ClassVar[dict[str, list[type[Message]]] | None] = None
    OMIT_NONE: ClassVar[frozenset[str]] = frozenset()

    def __init_subclass__(cls, tag: str | None = None, **kwargs: Any) -> None:
        # ``class Ping(Message, tag="ping")`` names the type on the wire; untagged
        # classes only share fields
        super().__init_subclass__(**kwargs)
        if tag is not None:
            cls.TAG = tag
            if cls.REGISTRY is not None:
                cls.REGISTRY.setdefault(tag, []).append(cls)

    def to_wire(self) -> dict[str, Any]:
        """The JSON object of this message (``"t"`` first; see :func:`~elasticep.wire.values.plain`)."""
        out: dict[str, Any] = {"t": self.TAG}
        for name, enc in field_encoders(type(self)):
            value = getattr(self, name)
            if value is None:
                if name not in self.OMIT_NONE:
                    out[name] = None
            else:
                out[name] = value if enc is None else enc(value)
        return out

    @classmethod
    def _from_fields(cls, d: dict[str, Any]) -> Message:
        """The message of class ``cls`` from its decoded object ``d``. Raises
        ProtocolError."""
        spec, names = message_spec(cls)
        extra = d.keys() - names
        if extra:
            raise ProtocolError(f"{cls.TAG!r} message has unknown field(s) {sorted(extra)}",
                                request_id(d))
        kw = {}
        for name, where, simple, conv, optional in spec:
            if name in d:
                v = d[name]
                # a plain JSON value of the declared type needs no conversion
                kw[name] = v if type(v) in simple else conv(v, where, d)
            elif not optional:
                raise ProtocolError(f"{cls.TAG!r} message lacks field {name!r}", request_id(d))
        return cls(**kw)


def by_tag(classes: Iterable[type[Message]]) -> dict[str, list[type[Message]]]:
    """``{TAG: [classes]}`` of ``classes``: what :func:`decode` takes."""
    out: dict[str, list[type[Message]]] = {}
    for cls in classes:
        out.setdefault(cls.TAG, []).append(cls)
    return out


def decode(d: Any, classes: Mapping[str, list[type[Message]]],
           kind: str = "message") -> Message:
    """Turn one decoded JSON value into its message, of one of ``classes``.

    Args:
        classes: the types the receiver takes, by tag (:func:`by_tag`, or a registry).
        kind: names the boundary in errors ("control message", ...).
    Raises:
        ProtocolError: not an object, no ``"t"`` or one not in ``classes``, or a field
            missing, unknown or of the wrong type.
    """
    if not isinstance(d, dict):
        raise ProtocolError(f"{kind} must be a JSON object, got {type(d).__name__}")
    tag = d.get("t")
    candidates = classes.get(tag) if isinstance(tag, str) else None
    if not candidates:
        raise ProtocolError(f"unknown {kind} type {tag!r}", request_id(d))
    for cls in sorted(candidates, key=lambda c: not c.MATCH):
        if all(d.get(k) == v for k, v in cls.MATCH):
            return cls._from_fields(d)
    raise ProtocolError(f"no variant of {tag!r} matches {sorted(d)}", request_id(d))


def encode_json(msg: Message) -> bytes:
    """One message as compact UTF-8 JSON (no newline)."""
    return json.dumps(msg.to_wire(), separators=(",", ":")).encode()


def decode_json(data: bytes, classes: Mapping[str, list[type[Message]]],
                kind: str = "message") -> Message:
    """Parse one JSON text into its message (as :func:`decode`). Raises ProtocolError."""
    try:
        d = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"{kind} is not JSON: {data[:60]!r} ({e})") from None
    return decode(d, classes, kind)
