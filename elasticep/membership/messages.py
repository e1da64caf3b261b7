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
                             retire, operation,
                             record_launch, clear_launch, reserve, release
===========================  ===============================================================

The base class and the decoding live in ``control_wire.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from . import control_wire
from .control_wire import ControlMessage, ProtocolError, plain
from .transitions import Decision, OnFailure, SlotState

# re-exported: callers read them as m.decode_line, m.from_wire, m.message_types
decode_line, from_wire, message_types = (control_wire.decode_line, control_wire.from_wire,
                                         control_wire.message_types)


# ---------------------------------------------------------------------- shared fields
# A class that adds no field to its base needs no @dataclass of its own.
@dataclass(frozen=True)
class _ToGroup(ControlMessage):
    group: str


@dataclass(frozen=True)
class _GroupSlots(_ToGroup):
    ranks: list[int]


@dataclass(frozen=True)
class _SlotView(_ToGroup):
    states: list[SlotState]
    requests: dict[str, list[int]]


@dataclass(frozen=True)
class _Launch(ControlMessage):
    rank: int
    pid: int


# ---------------------------------------------------------------------- rank -> coordinator
@dataclass(frozen=True)
class RankHello(ControlMessage, tag="hello"):
    """A rank's first request: it takes global rank ``rank``. Answer: store_port,
    hb_interval_s. ``is_extension``: a joiner (may only take a failed/free slot).

    ``resume``: set when a rank that lost its leader (``--membership-store``) says hello
    to the new one: group name -> ``[committed epoch, announced epoch it still waits to
    see committed, or 0]``. The new leader takes it back as the member it was
    (``takeover.py``).
    """

    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"id", "resume"})
    rank: int
    pid: int
    world_size: int
    max_world_size: int
    is_extension: bool
    resume: dict[str, list[int]] | None = None


class Heartbeat(ControlMessage, tag="hb"):
    """Sent every ``hb_interval_s`` seconds; answered with :class:`HeartbeatAck`."""


@dataclass(frozen=True)
class Register(_ToGroup, tag="register"):
    """Join group ``group`` (torch is creating it). ``global_ranks``: global rank per
    slot; ``active``: the slots active at creation. Answer: epoch, active, states,
    on_failure, slot."""

    global_ranks: list[int]
    active: list[int]
    on_failure: OnFailure
    is_extension: bool


@dataclass(frozen=True)
class EpochReport(_ToGroup, tag="report"):
    """Answer to :class:`Announce`: this member's op progress (``membership.Report``):
    last completed op, last started op, ops whose results it keeps."""

    epoch: int
    last: int
    started: int
    fetchable: list[int]


class Ready(_ToGroup, tag="ready"):
    """A joiner loaded its weights and waits to be admitted into ``group``."""


class Recover(_GroupSlots, tag="recover"):
    """A member asks to admit the ready slots ``ranks``. Answer: admitting (slots)."""


class Deactivate(_GroupSlots, tag="deactivate"):
    """A member asks to remove the active slots ``ranks``. Answer: removing (slots)."""


class Ping(ControlMessage, tag="ping"):
    """A round trip that confirms this rank is still a member (empty answer)."""


# ---------------------------------------------------------------------- coordinator -> rank
@dataclass(frozen=True)
class Reply(ControlMessage, tag="reply"):
    """The answer to the request with the same ``id``.

    ``ok`` False: ``error`` says why, ``code`` names the refusal (see
    ``errors.MembershipRequestError``). ``body``: the answer's fields, flat on the wire;
    read them with ``reply["name"]``.
    """

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

    def typed(self, name: str, hint: Any) -> Any:
        """A field of the answer, checked against (and turned into) type ``hint`` as a
        message's declared fields are (``list[SlotState]``, an enum, ...).

        Raises:
            ProtocolError: the field is missing or not of type ``hint``.
        """
        return control_wire.convert(self[name], hint, f"reply.{name}", {"id": self.id})

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"t": self.TAG, "id": self.id, "ok": self.ok}
        if self.error is not None:
            out["error"] = self.error
        if self.code is not None:
            out["code"] = self.code
        return {**out, **plain(self.body)}

    @classmethod
    def _from_fields(cls, d: dict[str, Any]) -> ControlMessage:
        head = {k: d[k] for k in ("t", "id", "ok", "error", "code") if k in d}
        return replace(super()._from_fields(head),
                       body={k: v for k, v in d.items() if k not in head})


class HeartbeatAck(ControlMessage, tag="hb_ack"):
    """The coordinator received a heartbeat (the rank's lease is fresh)."""


@dataclass(frozen=True)
class Announce(_ToGroup, tag="announce"):
    """A transition to ``epoch`` starts: report your progress (:class:`EpochReport`)."""

    epoch: int


@dataclass(frozen=True)
class Commit(_SlotView, tag="commit"):
    """The transition's decision, the slot states after it, and the supervisor requests
    not applied yet (they travel with the commit, so a rank never acts again on a
    request this commit applied)."""

    decision: Decision

    @property
    def epoch(self) -> int:
        return self.decision.epoch


class Peer(_SlotView, tag="peer"):
    """Slot states or supervisor requests changed without a new epoch."""


@dataclass(frozen=True)
class Evicted(ControlMessage, tag="evicted"):
    """The coordinator dropped this rank (heartbeat timeout, reported dead)."""

    reason: str


# pushes a rank routes to one group's GroupState
GroupPush = Announce | Commit | Peer


# ---------------------------------------------------------------------- supervisor -> coordinator
@dataclass(frozen=True)
class SupervisorHello(ControlMessage, tag="hello"):
    """A launcher, front-end or `join` connects. Answer: store_port."""

    MATCH: ClassVar[tuple[tuple[str, Any], ...]] = (("role", "supervisor"),)
    role: str = "supervisor"


class GetStatus(ControlMessage, tag="status"):
    """Answer: max_world_size, ranks, groups (``CoordinatorClient.status``)."""


@dataclass(frozen=True)
class ReportDeath(ControlMessage, tag="report_death"):
    """Declare global rank ``rank`` dead; with ``pid``, only if that pid holds the slot."""

    rank: int
    pid: int | None = None


class RequestAdmission(_GroupSlots, tag="request_admission"):
    """Ask the members of ``group`` to admit the slots ``ranks`` at a step boundary."""


class RequestDeactivation(_GroupSlots, tag="request_deactivation"):
    """Mark the slots ``ranks`` draining and ask the members to remove them."""


@dataclass(frozen=True)
class PublishDeployment(ControlMessage, tag="publish_deployment"):
    """Node 0 publishes the deployment's settings (JSON text) and its initial size."""

    config: str
    ep_size: int
    max_ep_size: int
    # the fewest healthy ranks whose expert slots hold every expert (a retirement that
    # keeps fewer is refused); 1: not known
    min_holding_ranks: int = 1
    # seconds a grow waits for its joiners before it gives up and frees their slots
    scale_timeout_s: float = 600.0


class GetDeploymentConfig(ControlMessage, tag="deployment_config"):
    """Answer: config (the published JSON text, or null)."""


class GetDeploymentStatus(ControlMessage, tag="deployment_status"):
    """Answer: status (the ``/elastic_ep_status`` object, ``DeploymentStatus``)."""


@dataclass(frozen=True)
class Scale(ControlMessage, tag="scale"):
    """Make ``new_ep_size`` the target. Answer: old_ep_size, slots, scale_phase,
    operation_id (``operation_id`` given again with the same size: the same operation,
    nothing changes), and superseded (the ids of the waiting grows it replaced), if
    any."""

    new_ep_size: int
    operation_id: str | None = None


@dataclass(frozen=True)
class Retire(ControlMessage, tag="retire"):
    """Retire the slots ``ranks``, or every slot whose last launch was on ``node`` (one
    of the two). Answer: as :class:`Scale`'s. ``keep_processes``: their workers stay up,
    idle, once out of the group, instead of exiting."""

    ranks: list[int] | None = None
    node: int | None = None
    operation_id: str | None = None
    keep_processes: bool = False


@dataclass(frozen=True)
class GetOperation(ControlMessage, tag="operation"):
    """Answer: the operation's phase and per-slot states (``operations.op_view``)."""

    operation_id: str


@dataclass(frozen=True)
class RecordLaunch(_Launch, tag="record_launch"):
    """A launcher on ``node`` started worker ``pid`` for ``rank``."""

    node: int


class ClearLaunch(_Launch, tag="clear_launch"):
    """Worker ``pid`` of ``rank`` exited."""


@dataclass(frozen=True)
class Reserve(ControlMessage, tag="reserve"):
    """Claim the slots ``ranks`` for a join in ``mode`` ("recover" | "scale"); ``who``
    names the claimant in refusals. Answer: ep_size."""

    ranks: list[int]
    mode: str
    who: str


@dataclass(frozen=True)
class Release(ControlMessage, tag="release"):
    """Drop this connection's claims of ``ranks`` (None: all of them)."""

    ranks: list[int] | None = None
