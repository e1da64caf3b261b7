"""Control-plane messages: one frozen dataclass per message type, and their wire form.

On the wire (``protocol.py``) a message is one JSON object: ``"t"`` names its type (the
class's ``TAG``) and every other key is a field of the class, under the same name. A
request that expects an answer carries ``"id"``; the answer is a :class:`Reply` with the
same id, ``{"t": "reply", "id", "ok", "error"?, "code"?, ...its fields}``. Pushes from
the coordinator carry no id.

===========================  ===============================================================
rank -> coordinator          hello (:class:`RankHello`), hb, register, report, ready,
                             recover, deactivate, ping
coordinator -> rank          reply, hb_ack, announce, commit, peer, evicted
supervisor -> coordinator    hello (:class:`SupervisorHello`, ``"role": "supervisor"``),
                             status, report_death, request_admission, request_deactivation,
                             publish_deployment, deployment_config, deployment_status, scale,
                             record_launch, clear_launch, reserve, release
===========================  ===============================================================

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
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any, ClassVar

from .membership import Decision, SlotState


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

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "TAG" in cls.__dict__:
            _BY_TAG.setdefault(cls.TAG, []).append(cls)

    def to_wire(self) -> dict[str, Any]:
        """The JSON object of this message (``"t"`` first; no ``"id"`` when None)."""
        out: dict[str, Any] = {"t": self.TAG}
        for f in fields(self):
            value = getattr(self, f.name)
            if not (f.name == "id" and value is None):
                out[f.name] = _plain(value)
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
                kw[f.name] = _convert(d[f.name], hints[f.name], f"{cls.TAG}.{f.name}", d)
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


def _plain(value: Any) -> Any:
    """A field's value as JSON-ready data (enums as their values, Decision as its dict)."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Decision):
        return value.to_dict()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _convert(value: Any, hint: Any, where: str, msg: dict) -> Any:
    """``value`` as read from JSON, checked against (and turned into) type ``hint``."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        for h in typing.get_args(hint):
            try:
                return _convert(value, h, where, msg)
            except ProtocolError:
                pass
    elif hint is type(None):
        if value is None:
            return None
    elif origin is list:
        if isinstance(value, list):
            (item,) = typing.get_args(hint)
            return [_convert(v, item, where, msg) for v in value]
    elif origin is dict:
        if isinstance(value, dict):
            _key, item = typing.get_args(hint)
            return {k: _convert(v, item, where, msg) for k, v in value.items()}
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


# ---------------------------------------------------------------------- rank -> coordinator
@dataclass(frozen=True)
class RankHello(Message):
    """A rank's first request: it takes global rank ``rank``. Answer: store_port,
    hb_interval_s. ``is_extension``: a joiner (may only take a failed/free slot)."""

    TAG: ClassVar[str] = "hello"
    rank: int
    pid: int
    world_size: int
    max_world_size: int
    is_extension: bool


@dataclass(frozen=True)
class Heartbeat(Message):
    """Sent every ``hb_interval_s`` seconds; answered with :class:`HeartbeatAck`."""

    TAG: ClassVar[str] = "hb"


@dataclass(frozen=True)
class Register(Message):
    """Join group ``group`` (torch is creating it). ``global_ranks``: global rank per
    slot; ``active``: the slots active at creation. Answer: epoch, active, states,
    on_failure, slot."""

    TAG: ClassVar[str] = "register"
    group: str
    global_ranks: list[int]
    active: list[int]
    on_failure: str
    is_extension: bool


@dataclass(frozen=True)
class EpochReport(Message):
    """Answer to :class:`Announce`: this member's op progress (``membership.Report``):
    last completed op, last started op, ops whose results it keeps."""

    TAG: ClassVar[str] = "report"
    group: str
    epoch: int
    last: int
    started: int
    fetchable: list[int]


@dataclass(frozen=True)
class Ready(Message):
    """A joiner loaded its weights and waits to be admitted into ``group``."""

    TAG: ClassVar[str] = "ready"
    group: str


@dataclass(frozen=True)
class Recover(Message):
    """A member asks to admit the ready slots ``ranks``. Answer: admitting (slots)."""

    TAG: ClassVar[str] = "recover"
    group: str
    ranks: list[int]


@dataclass(frozen=True)
class Deactivate(Message):
    """A member asks to remove the active slots ``ranks``. Answer: removing (slots)."""

    TAG: ClassVar[str] = "deactivate"
    group: str
    ranks: list[int]


@dataclass(frozen=True)
class Ping(Message):
    """A round trip that confirms this rank is still a member (empty answer)."""

    TAG: ClassVar[str] = "ping"


# ---------------------------------------------------------------------- coordinator -> rank
@dataclass(frozen=True)
class Reply(Message):
    """The answer to the request with the same ``id``.

    ``ok`` False: ``error`` says why, ``code`` names the refusal (see
    ``errors.MembershipRequestError``). ``body``: the answer's fields, flat on the wire;
    read them with ``reply["name"]``.
    """

    TAG: ClassVar[str] = "reply"
    ok: bool
    error: str | None = None
    code: str | None = None
    body: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Any:
        """A field of the answer. Raises ProtocolError if the coordinator left it out."""
        try:
            return self.body[name]
        except KeyError:
            raise ProtocolError(f"reply {self.id} has no field {name!r}") from None

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"t": self.TAG, "id": self.id, "ok": self.ok}
        if self.error is not None:
            out["error"] = self.error
        if self.code is not None:
            out["code"] = self.code
        return {**out, **_plain(self.body)}

    @classmethod
    def _from_fields(cls, d: dict[str, Any]) -> Message:
        head = {k: d[k] for k in ("t", "id", "ok", "error", "code") if k in d}
        return replace(super()._from_fields(head),
                       body={k: v for k, v in d.items() if k not in head})


@dataclass(frozen=True)
class HeartbeatAck(Message):
    """The coordinator received a heartbeat (the rank's lease is fresh)."""

    TAG: ClassVar[str] = "hb_ack"


@dataclass(frozen=True)
class Announce(Message):
    """A transition to ``epoch`` starts: report your progress (:class:`EpochReport`)."""

    TAG: ClassVar[str] = "announce"
    group: str
    epoch: int


@dataclass(frozen=True)
class Commit(Message):
    """The transition's decision, the slot states after it, and the supervisor requests
    not applied yet (they travel with the commit, so a rank never acts again on a
    request this commit applied)."""

    TAG: ClassVar[str] = "commit"
    group: str
    decision: Decision
    states: list[SlotState]
    requests: dict[str, list[int]]

    @property
    def epoch(self) -> int:
        return self.decision.epoch


@dataclass(frozen=True)
class Peer(Message):
    """Slot states or supervisor requests changed without a new epoch."""

    TAG: ClassVar[str] = "peer"
    group: str
    states: list[SlotState]
    requests: dict[str, list[int]]


@dataclass(frozen=True)
class Evicted(Message):
    """The coordinator dropped this rank (heartbeat timeout, reported dead)."""

    TAG: ClassVar[str] = "evicted"
    reason: str


# pushes a rank routes to one group's GroupState
GroupPush = Announce | Commit | Peer


# ---------------------------------------------------------------------- supervisor -> coordinator
@dataclass(frozen=True)
class SupervisorHello(Message):
    """A launcher, front-end or `join` connects. Answer: store_port."""

    TAG: ClassVar[str] = "hello"
    MATCH: ClassVar[tuple[tuple[str, Any], ...]] = (("role", "supervisor"),)
    role: str = "supervisor"


@dataclass(frozen=True)
class GetStatus(Message):
    """Answer: max_world_size, ranks, groups (``CoordinatorClient.status``)."""

    TAG: ClassVar[str] = "status"


@dataclass(frozen=True)
class ReportDeath(Message):
    """Declare global rank ``rank`` dead; with ``pid``, only if that pid holds the slot."""

    TAG: ClassVar[str] = "report_death"
    rank: int
    pid: int | None = None


@dataclass(frozen=True)
class RequestAdmission(Message):
    """Ask the members of ``group`` to admit the slots ``ranks`` at a step boundary."""

    TAG: ClassVar[str] = "request_admission"
    group: str
    ranks: list[int]


@dataclass(frozen=True)
class RequestDeactivation(Message):
    """Mark the slots ``ranks`` draining and ask the members to remove them."""

    TAG: ClassVar[str] = "request_deactivation"
    group: str
    ranks: list[int]


@dataclass(frozen=True)
class PublishDeployment(Message):
    """Node 0 publishes the deployment's settings (JSON text) and its initial size."""

    TAG: ClassVar[str] = "publish_deployment"
    config: str
    ep_size: int
    max_ep_size: int


@dataclass(frozen=True)
class GetDeploymentConfig(Message):
    """Answer: config (the published JSON text, or null)."""

    TAG: ClassVar[str] = "deployment_config"


@dataclass(frozen=True)
class GetDeploymentStatus(Message):
    """Answer: status (the ``/elastic_ep_status`` object, ``DeploymentStatus``)."""

    TAG: ClassVar[str] = "deployment_status"


@dataclass(frozen=True)
class Scale(Message):
    """Make ``new_ep_size`` the target. Answer: old_ep_size, slots, scale_phase."""

    TAG: ClassVar[str] = "scale"
    new_ep_size: int


@dataclass(frozen=True)
class RecordLaunch(Message):
    """A launcher on ``node`` started worker ``pid`` for ``rank``."""

    TAG: ClassVar[str] = "record_launch"
    rank: int
    node: int
    pid: int


@dataclass(frozen=True)
class ClearLaunch(Message):
    """Worker ``pid`` of ``rank`` exited."""

    TAG: ClassVar[str] = "clear_launch"
    rank: int
    pid: int


@dataclass(frozen=True)
class Reserve(Message):
    """Claim the slots ``ranks`` for a join in ``mode`` ("recover" | "scale"); ``who``
    names the claimant in refusals. Answer: ep_size."""

    TAG: ClassVar[str] = "reserve"
    ranks: list[int]
    mode: str
    who: str


@dataclass(frozen=True)
class Release(Message):
    """Drop this connection's claims of ``ranks`` (None: all of them)."""

    TAG: ClassVar[str] = "release"
    ranks: list[int] | None = None
