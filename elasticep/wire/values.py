"""The checked conversion of message field values to and from their JSON form: what
:mod:`elasticep.wire`'s messages are made of.

Values may be ints, floats, strs, bools, None, enums (sent as their values), lists,
tuples (``tuple[X, ...]``, or of fixed length such as ``tuple[int, float]``; sent as
lists), dicts with str keys, nested dataclasses (sent as objects of their fields) and
the types given a codec with :func:`register_codec`. The check of each annotation is
compiled once into a small function (:func:`converter`), and so is each type's encoding
(:func:`encoder`). It imports only the standard library.
"""

from __future__ import annotations

import enum
import functools
import itertools
import json
import operator
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, fields, is_dataclass
from typing import Any

# checks one JSON value against a type and returns it as that type:
# conv(value, where, message) where `where` names the value in errors ("tag.field") and
# `message` is the whole decoded object (for its request id)
Converter = Callable[[Any, str, dict], Any]


class ProtocolError(ValueError):
    """A message that is not JSON, has an unknown type, or a missing, extra or mistyped
    field.

    Attributes:
        rid: the message's request id, when one could be read (so the sender can be
            answered instead of waiting for its timeout).
    """

    code = "malformed"  # the refusal code a control Reply carries

    def __init__(self, reason: str, rid: int | None = None) -> None:
        super().__init__(reason)
        self.rid = rid


_CODECS: dict[type, tuple[Callable[[Any], Any], Callable[[Any], Any]]] = {}


def register_codec(cls: type, to_plain: Callable[[Any], Any],
                   from_plain: Callable[[Any], Any]) -> None:
    """Send values of ``cls`` as ``to_plain(value)`` and read them back with
    ``from_plain`` (which raises KeyError, TypeError, ValueError or AttributeError on a
    bad value). For types whose JSON form is not their fields (int-keyed dicts, say)."""
    _CODECS[cls] = (to_plain, from_plain)
    for cache in (converter, encoder, message_spec, field_encoders):  # compiled without the codec
        cache.cache_clear()


def plain(value: Any) -> Any:
    """A value as JSON-ready data (enums as their values, dataclasses as their fields)."""
    if isinstance(value, (str, int, float)) and not isinstance(value, enum.Enum):
        return value  # most values: checked first, it is the per-token path
    if value is None:
        return None
    codec = _CODECS.get(type(value))
    if codec is not None:
        return codec[0](value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if is_dataclass(value):
        return {name: plain(getattr(value, name)) for name in _field_names(type(value))}
    return value


def convert(value: Any, hint: Any, where: str, msg: dict) -> Any:
    """``value`` as read from JSON, checked against (and turned into) type ``hint``.

    Args:
        where: names the value in the error (``"tag.field"``); msg: the whole message,
            for its request id.
    Raises:
        ProtocolError: ``value`` is not of type ``hint``.
    """
    return converter(hint)(value, where, msg)


def _fixed_tuple(args: tuple[Any, ...], fail: Callable[..., typing.NoReturn]) -> Converter:
    """A ``tuple[X, Y, ...]`` of fixed length (a ``(token id, logprob)`` pair): a JSON
    list of exactly that many items, each checked against its own type."""
    items = [converter(a) for a in args]

    def fixed(v: Any, w: str, m: dict) -> tuple:
        if not isinstance(v, list) or len(v) != len(items):
            fail(v, w, m)
        return tuple(conv(x, w, m) for conv, x in zip(items, v, strict=True))
    return fixed


@functools.cache
def converter(hint: Any) -> Converter:
    """The compiled check of type ``hint`` (see :func:`convert`), built once per type."""
    name = getattr(hint, "__name__", None) or str(hint)

    def fail(value: Any, where: str, msg: dict) -> typing.NoReturn:
        raise ProtocolError(f"{where}: expected {name}, got {json.dumps(value)[:60]}",
                            request_id(msg))

    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return lambda v, w, m: v
    if origin in (typing.Union, types.UnionType):
        return _union(args, fail)
    if hint is type(None):
        return lambda v, w, m: None if v is None else fail(v, w, m)
    if origin is tuple and args and Ellipsis not in args:
        return _fixed_tuple(args, fail)
    if origin in (list, tuple):
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            raise TypeError(f"only tuple[X, ...] and tuple[X, Y] fields are supported, "
                            f"not {hint}")
        item, make = converter(args[0]), (list if origin is list else tuple)
        if _flat(args[0]):
            return _rows(args[0], make, fail)
        simple = _simple(args[0])

        def sequence(v, w, m):
            if not isinstance(v, list):
                fail(v, w, m)
            if simple and all(type(x) in simple for x in v):  # token ids: one C loop
                return make(v)
            return make([item(x, w, m) for x in v])
        return sequence
    if origin is dict:
        val = converter(args[1])
        return lambda v, w, m: ({k: val(x, w, m) for k, x in v.items()}
                                if isinstance(v, dict) else fail(v, w, m))
    if hint in _CODECS:
        return _guarded(_CODECS[hint][1], (KeyError, TypeError, ValueError, AttributeError),
                        fail)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _guarded(hint, (ValueError, TypeError), fail)
    if hint is float:
        return lambda v, w, m: (float(v) if isinstance(v, (int, float))
                                and not isinstance(v, bool) else fail(v, w, m))
    if hint is int:
        return lambda v, w, m: (v if isinstance(v, int) and not isinstance(v, bool)
                                else fail(v, w, m))
    if isinstance(hint, type) and is_dataclass(hint):
        return _nested(hint, fail)
    if isinstance(hint, type):
        return lambda v, w, m: v if isinstance(v, hint) else fail(v, w, m)
    raise TypeError(f"no wire form for fields of type {hint}")


def _union(args: tuple, fail: Callable) -> Converter:
    arms = [converter(h) for h in args if h is not type(None)]
    nullable = type(None) in args
    if nullable and len(arms) == 1:  # X | None: the common case, one arm to try
        (arm,) = arms

        def optional(v, w, m):
            if v is None:
                return None
            try:
                return arm(v, w, m)
            except ProtocolError:
                fail(v, w, m)
        return optional

    def union(v, w, m):
        if v is None and nullable:
            return None
        for arm in arms:
            try:
                return arm(v, w, m)
            except ProtocolError:
                pass
        fail(v, w, m)
    return union


def _guarded(make: Callable[[Any], Any], errors: tuple, fail: Callable) -> Converter:
    def guarded(v, w, m):
        try:
            return make(v)
        except errors:
            fail(v, w, m)
    return guarded


def _nested(cls: type, fail: Callable) -> Converter:
    """A dataclass field that is not a message: an object of its fields, no ``"t"``."""
    hints = typing.get_type_hints(cls)
    spec = [(f.name, _simple(hints[f.name]), converter(hints[f.name]), _has_default(f))
            for f in fields(cls)]
    names = frozenset(n for n, *_ in spec)

    def nested(v, w, m):
        if not isinstance(v, dict):
            fail(v, w, m)
        if not v.keys() <= names:
            raise ProtocolError(f"{w}: unknown field(s) {sorted(v.keys() - names)}", request_id(m))
        kw = {}
        for n, simple, conv, optional in spec:
            if n in v:
                x = v[n]
                kw[n] = x if type(x) in simple else conv(x, f"{w}.{n}", m)
            elif not optional:
                raise ProtocolError(f"{w}: lacks field {n!r}", request_id(m))
        return cls(**kw)
    return nested


def _rows(cls: type, make: Callable, fail: Callable) -> Converter:
    """A list or tuple of flat dataclasses (:func:`_flat`), sent as rows: one array of
    field values per item, in field order (no repeated keys: the worker's tokens)."""
    hints = typing.get_type_hints(cls)
    kinds = [(f.name, _simple(hints[f.name])) for f in fields(cls)]
    # every allowed tuple of the row's value types (a few: one per mix of None fields),
    # so a row is checked with one C-level lookup
    allowed = frozenset(itertools.product(*(s for _n, s in kinds)))

    def rows(v, w, m):
        if not isinstance(v, list):
            fail(v, w, m)
        out = []
        for row in v:
            if type(row) is not list or tuple(map(type, row)) not in allowed:
                raise ProtocolError(f"{w}: expected rows of {cls.__name__} "
                                    f"{[n for n, _s in kinds]}, got {json.dumps(row)[:60]}",
                                    request_id(m))
            out.append(cls(*row))
        return make(out)
    return rows


def _flat(hint: Any) -> bool:
    """A dataclass (not a message) whose every field is a str, int, bool or None, or a
    union of those: a list of them travels as rows (floats are left out, since JSON
    may read a whole float back as an int)."""
    from elasticep.wire import Message  # the base built on these values, imported late

    if not (isinstance(hint, type) and is_dataclass(hint)) or issubclass(hint, Message):
        return False
    hints = typing.get_type_hints(hint)
    return all(_simple(hints[f.name]) and float not in _simple(hints[f.name])
               for f in fields(hint))


_PRIMITIVE = (str, int, float, bool)


def _simple(hint: Any) -> frozenset[type]:
    """The JSON value types that are already of type ``hint`` as read (str for str,
    int for int; with ``| None`` also NoneType): those skip the converter. Exact types,
    so a bool never passes for an int."""
    args = typing.get_args(hint) if typing.get_origin(hint) in (
        typing.Union, types.UnionType) else (hint,)
    if all(a in _PRIMITIVE or a is type(None) for a in args):
        return frozenset(args)
    return frozenset()


@functools.cache
def message_spec(cls: type) -> tuple[list[tuple[str, str, frozenset, Converter, bool]],
                              frozenset[str]]:
    """Per field of message class ``cls``: (name, "tag.name", its simple JSON types,
    converter, has a default), and the keys its wire object may hold."""
    hints = typing.get_type_hints(cls)
    spec = [(f.name, f"{cls.TAG}.{f.name}", _simple(hints[f.name]),
             converter(hints[f.name]), _has_default(f)) for f in fields(cls)]
    return spec, frozenset(n for n, *_ in spec) | {"t"}


# ---------------------------------------------------------------------- encoding
# An encoder turns a (non-None) value of one type into what `plain` gives for it; None
# stands for "the value as it is" (str, int, float, bool and JSON-ready containers).
Encoder = Callable[[Any], Any] | None


@functools.cache
def encoder(hint: Any) -> Encoder:
    """The compiled :func:`plain` of values of type ``hint``, built once per type."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in _PRIMITIVE or hint is type(None):
        return None
    if origin in (typing.Union, types.UnionType):
        arms = [a for a in args if a is not type(None)]
        if len(arms) != 1:
            return plain
        arm = encoder(arms[0])
        return None if arm is None else (lambda v: None if v is None else arm(v))
    if origin in (list, tuple):
        if _flat(args[0]):  # rows (see _rows): each item's fields in one C-level read
            names = tuple(f.name for f in fields(args[0]))
            get = operator.attrgetter(*names)
            if len(names) == 1:
                return lambda v: [[get(x)] for x in v]
            return lambda v: [get(x) for x in v]
        item = encoder(args[0])
        return list if item is None else (lambda v: [item(x) for x in v])
    if origin is dict:
        val = encoder(args[1])
        return dict if val is None else (lambda v: {k: val(x) for k, x in v.items()})
    if hint in _CODECS:
        return _CODECS[hint][0]
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return operator.attrgetter("value")
    if isinstance(hint, type) and is_dataclass(hint):
        encs = field_encoders(hint)
        names = tuple(n for n, _e in encs)
        if all(e is None for _n, e in encs):  # every field as it is: one C-level read
            get = operator.attrgetter(*names)
            if len(names) == 1:
                return lambda v: {names[0]: get(v)}
            return lambda v: dict(zip(names, get(v), strict=True))

        def fields_of(v):
            out = {}
            for n, e in encs:
                x = getattr(v, n)
                out[n] = x if e is None or x is None else e(x)
            return out
        return fields_of
    return plain  # Any, or a type decided at run time


@functools.cache
def field_encoders(cls: type) -> tuple[tuple[str, Encoder], ...]:
    """(field name, encoder) per field of dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    return tuple((f.name, encoder(hints[f.name])) for f in fields(cls))


def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(n for n, _e in field_encoders(cls))


def request_id(d: dict) -> int | None:
    rid = d.get("id")
    return rid if isinstance(rid, int) and not isinstance(rid, bool) else None


def _has_default(f) -> bool:
    return f.default is not MISSING or f.default_factory is not MISSING
