"""The deployment's membership as one typed value: the ``/elastic_ep_status`` shape.

The coordinator builds it (:meth:`CoordinatorClient.deployment_status`); the front-end
adds ``running_requests`` and serves it as JSON; `join`, the supervisor and the test
harness read it. Nobody takes a raw coordinator snapshot apart anywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from .transitions import ScalePhase, SlotState


@dataclass(frozen=True)
class RankStatus:
    """One slot.

    Attributes:
        rank: global slot id.
        state: its state (a worker still loading shows ``JOINING``).
        pid: the worker process holding (or last holding) the slot; None if never started.
        node: the node its launcher runs on; None where the coordinator has not
            recorded a launch for it (a new leader, before that node launches again).
        running_requests: requests the front-end has on it (None where not known).
        max_total_tokens: its KV-cache capacity in tokens, as it reported (None where
            not known).
        max_running_requests: the most requests it runs at once, as it reported.
        moe_a2a_backend: the MoE transport it runs, as it reported (``cuda_ipc`` or
            ``all_to_all``; None where not known).
    """

    rank: int
    state: SlotState
    pid: int | None = None
    node: int | None = None
    running_requests: int | None = None
    max_total_tokens: int | None = None
    max_running_requests: int | None = None
    moe_a2a_backend: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON entry (the front-end's counts and the rank's limits only where known)."""
        d: dict[str, Any] = {"rank": self.rank, "state": self.state.value, "pid": self.pid,
                             "node": self.node}
        for name in (*_OPTIONAL, "moe_a2a_backend"):
            if getattr(self, name) is not None:
                d[name] = getattr(self, name)
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> RankStatus:
        """Parse one entry of ``ranks``. Raises KeyError / ValueError on a bad entry."""
        pid = d.get("pid")
        backend = d.get("moe_a2a_backend")
        return RankStatus(int(d["rank"]), SlotState(d["state"]),
                          None if pid is None else int(pid),
                          None if d.get("node") is None else int(d["node"]),
                          **{n: int(d[n]) for n in _OPTIONAL if d.get(n) is not None},
                          moe_a2a_backend=None if backend is None else str(backend))


_OPTIONAL = ("running_requests", "max_total_tokens", "max_running_requests")


@dataclass(frozen=True)
class StoreStatus:
    """Where the membership is kept (``--membership-store``) and how that goes.

    Attributes:
        kind: ``"etcd"`` (the embedded default shows no entry).
        ok: the newest membership is committed there.
        reason: why not, in one line (None when ok).
        revision: the store revision of the coordinator's last commit or read.
        leader: the id of the coordinator that answered, if it holds the leader lease.
    """

    kind: str
    ok: bool
    reason: str | None = None
    revision: int = 0
    leader: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "ok": self.ok, "reason": self.reason,
                "revision": self.revision, "leader": self.leader}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> StoreStatus:
        return StoreStatus(str(d["kind"]), bool(d["ok"]), d.get("reason"),
                           int(d.get("revision", 0)), d.get("leader"))


@dataclass(frozen=True)
class DeploymentStatus:
    """The ``/elastic_ep_status`` body.

    Attributes:
        epoch: WORLD's committed membership epoch (0 before the first rank registers).
        ep_size: the target number of active ranks (the last scale's, else ``--ep-size``).
        max_ep_size: capacity (slots ``[0, max_ep_size)``).
        scale_phase: where a scale stands.
        ranks: one entry per slot, by rank.
        waiting_slots: the slots a grow waits for (no ready joiner yet), sorted.
        membership_store: the store's state with ``--membership-store etcd://``; None
            with the embedded coordinator (and then absent from the JSON).
    """

    epoch: int = 0
    ep_size: int = 0
    max_ep_size: int = 0
    scale_phase: ScalePhase = ScalePhase.IDLE
    ranks: tuple[RankStatus, ...] = field(default_factory=tuple)
    waiting_slots: tuple[int, ...] = ()
    membership_store: StoreStatus | None = None

    # ---- reading -----------------------------------------------------------------
    def rank(self, rank: int) -> RankStatus:
        """The entry of ``rank``. Raises KeyError if the status names no such rank."""
        for r in self.ranks:
            if r.rank == rank:
                return r
        raise KeyError(f"rank {rank} is not in the status")

    def state_of(self, rank: int) -> SlotState | None:
        """The state of ``rank``; None if the status does not list it."""
        return next((r.state for r in self.ranks if r.rank == rank), None)

    def states(self) -> dict[int, SlotState]:
        """rank -> state."""
        return {r.rank: r.state for r in self.ranks}

    def pids(self) -> dict[int, int]:
        """rank -> pid, for the ranks that have one."""
        return {r.rank: r.pid for r in self.ranks if r.pid is not None}

    def healthy_ranks(self) -> list[int]:
        """Ranks in state ``HEALTHY``, sorted."""
        return sorted(r.rank for r in self.ranks if r.state == SlotState.HEALTHY)

    def all_healthy(self) -> bool:
        """Exactly ``ep_size`` ranks are healthy and no scale is running."""
        return (len(self.healthy_ranks()) == self.ep_size
                and self.scale_phase == ScalePhase.IDLE)

    def degraded(self) -> bool:
        """Fewer healthy ranks than the target, or a slot failed or in between states.

        A planned scale-down is not degraded: its draining ranks are above the new
        target, which the healthy ranks meet (a scale-up is, until its joiners are in:
        the target counts them).
        """
        return (len(self.healthy_ranks()) < self.ep_size
                or any(r.state not in (SlotState.HEALTHY, SlotState.FREE, SlotState.DRAINING)
                       for r in self.ranks))

    # ---- wire --------------------------------------------------------------------
    def with_running(self, running: dict[int, int],
                     limits: dict[int, tuple[int | None, int | None]] | None = None,
                     transports: dict[int, str | None] | None = None) -> DeploymentStatus:
        """A copy with each rank's ``running_requests`` filled in from ``running``, its
        ``(max_total_tokens, max_running_requests)`` from ``limits`` and its
        ``moe_a2a_backend`` from ``transports``, where given."""
        limits, transports = limits or {}, transports or {}
        return replace(self, ranks=tuple(
            replace(r, running_requests=running.get(r.rank, 0),
                    moe_a2a_backend=transports.get(r.rank),
                    **dict(zip(("max_total_tokens", "max_running_requests"),
                               limits.get(r.rank, (None, None)), strict=True)))
            for r in self.ranks))

    def to_dict(self) -> dict[str, Any]:
        """The JSON body."""
        out = {"epoch": self.epoch, "ep_size": self.ep_size, "max_ep_size": self.max_ep_size,
               "scale_phase": self.scale_phase.value,
               "ranks": [r.to_dict() for r in self.ranks]}
        if self.waiting_slots:
            out["waiting_slots"] = list(self.waiting_slots)
        if self.membership_store is not None:
            out["membership_store"] = self.membership_store.to_dict()
        return out

    @staticmethod
    def from_dict(d: dict[str, Any]) -> DeploymentStatus:
        """Parse the JSON body. Raises KeyError / ValueError on a malformed body."""
        store = d.get("membership_store")
        return DeploymentStatus(int(d["epoch"]), int(d["ep_size"]), int(d["max_ep_size"]),
                                ScalePhase(d["scale_phase"]),
                                tuple(RankStatus.from_dict(r) for r in d["ranks"]),
                                tuple(int(s) for s in d.get("waiting_slots", ())),
                                None if store is None else StoreStatus.from_dict(store))
