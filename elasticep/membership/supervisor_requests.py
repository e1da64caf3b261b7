"""The coordinator's answers to supervisors (launchers, the front-end, `join`).

A mixin of :class:`~elasticep.membership.service.MembershipService`: every handler
reads or changes its groups and its
:class:`~elasticep.membership.registry.DeploymentRecords`. The decisions (scale plans,
the status view, join checks) are the pure functions of ``scaling.py``. Each handler
names the request type it answers (``dispatch.handles``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from . import messages as m
from .errors import JoinRefusedError
from .handlers import Role, handles
from .operations import Operation, op_view
from .registry import DeploymentRecords, Group
from .scaling import ProcInfo, ScalePlan, ScaleTarget, check_join, deployment_status
from .status import StoreStatus
from .transitions import SlotState

log = logging.getLogger("elasticep.membership")

WORLD = "world"


class SupervisorRequests:
    """Handlers of the supervisor messages (``messages.py``); each takes the peer (a
    ``_Supervisor``, or any peer where its role is None) and the message, and returns
    the reply's fields."""

    _groups: dict[str, Group]
    _procs: dict[int, Any]
    _deployment: DeploymentRecords
    _max_world_size: int | None
    _clock: Any
    # what the server says of its --membership-store, added to every status (the
    # embedded default: None, no entry)
    store_status: Callable[[], StoreStatus | None] = staticmethod(lambda: None)

    # ------------------------------------------------------------------ groups
    def _group(self, name: str) -> Group:
        """Raises ValueError (one line) for a group nobody registered."""
        g = self._groups.get(name)
        if g is None:
            raise ValueError(f"no group {name!r} is registered")
        return g

    @handles(m.GetStatus)
    def _status(self, proc, msg: m.GetStatus) -> dict:
        return {
            "max_world_size": self._max_world_size,
            "ranks": {str(r): {"pid": p.pid, "alive": p.alive, "groups": sorted(p.groups)}
                      for r, p in self._procs.items()},
            "groups": {n: g.status() for n, g in self._groups.items()},
        }

    @handles(m.ReportDeath)
    def _report_death(self, proc, msg: m.ReportDeath) -> dict:
        p = self._procs.get(msg.rank)
        if p is not None and p.alive and (msg.pid in (None, p.pid)):
            self._evict(p, "reported dead by supervisor")
        return {}

    @handles(m.RequestAdmission)
    def _request_admission(self, proc, msg: m.RequestAdmission) -> dict:
        g = self._group(msg.group)
        g.request("admit", msg.ranks)
        self._push_peer(g)
        return {}

    @handles(m.RequestDeactivation)
    def _request_deactivation(self, proc, msg: m.RequestDeactivation) -> dict:
        g = self._group(msg.group)
        for r in msg.ranks:
            if g.states[r] == SlotState.HEALTHY:
                g.set_state(r, SlotState.DRAINING)
        g.request("remove", msg.ranks)
        self._push_peer(g)
        return {}

    # ------------------------------------------------------------------ deployment
    @handles(m.PublishDeployment)
    def _publish_deployment(self, sup, msg: m.PublishDeployment) -> dict:
        d = self._deployment
        d.config = msg.config
        if d.target is None:
            d.target = ScaleTarget(msg.ep_size, msg.max_ep_size)
        d.min_holding_ranks = msg.min_holding_ranks
        d.scale_timeout_s = msg.scale_timeout_s
        return {}

    @handles(m.GetDeploymentConfig)
    def _deployment_config(self, sup, msg: m.GetDeploymentConfig) -> dict:
        return {"config": self._deployment.config}

    def _target(self) -> ScaleTarget:
        if self._deployment.target is None:
            raise ValueError("no deployment was published to this coordinator yet")
        return self._deployment.target

    def _world_view(self) -> tuple[int, list[SlotState] | None, list[int]]:
        world = self._groups.get(WORLD)
        if world is None:
            return 0, None, list(range(self._target().max_ep_size))
        return world.epoch, list(world.states), list(world.ranks)

    def _proc_infos(self) -> dict[int, ProcInfo]:
        return {r: ProcInfo(p.pid, p.alive, WORLD in p.groups) for r, p in self._procs.items()}

    @handles(m.GetDeploymentStatus)
    def _deployment_status(self, sup, msg: m.GetDeploymentStatus) -> dict:
        epoch, states, ranks = self._world_view()
        d = self._deployment
        status = deployment_status(epoch, states, ranks, self._target(), self._proc_infos(),
                                   d.live_launches(), d.nodes)
        return {"status": replace(status, membership_store=self.store_status()).to_dict()}

    @handles(m.Scale)
    def _scale(self, sup, msg: m.Scale) -> dict:
        request = {"new_ep_size": msg.new_ep_size}
        return self._operation(msg.operation_id, request,
                               lambda states: self._target().plan(msg.new_ep_size, states))

    @handles(m.Retire)
    def _retire(self, sup, msg: m.Retire) -> dict:
        if (msg.ranks is None) == (msg.node is None):
            raise ValueError("give either retire_ranks or drain_node")
        request: dict[str, Any] = ({"retire_ranks": list(msg.ranks)} if msg.ranks is not None
                                   else {"drain_node": msg.node})
        if msg.keep_processes:  # part of the request: a repeat without it is another one
            request["keep_processes"] = True

        def plan(states: list[SlotState]) -> ScalePlan:
            target = self._target()
            ranks = msg.ranks
            if ranks is None:
                ranks = sorted(r for r in target.members
                               if self._deployment.nodes.get(r) == msg.node)
                if not ranks:
                    raise ValueError(f"node {msg.node} runs no rank of the deployment")
            plan = target.retire(ranks, states, self._deployment.min_holding_ranks)
            if msg.keep_processes:  # pushed with the removal request that follows
                self._groups[WORLD].keep_processes(list(plan.remove))
            return plan

        return self._operation(msg.operation_id, request, plan)

    def _operation(self, op_id: str | None, request: dict, plan_fn) -> dict:
        """Run one scale or retire request as an operation: a repeat of a recorded one
        (same id, same request) answers it again and changes nothing."""
        ops = self._deployment.operations
        repeated = ops.repeat(op_id, request)
        if repeated is not None:
            return {**repeated.reply, "repeated": True}
        epoch, states, _ranks = self._world_view()
        if states is None:
            raise ValueError("the deployment has no ranks yet; wait for serve's ready line")
        plan = plan_fn(states)
        for slot in plan.free:
            self._groups[WORLD].set_state(slot, SlotState.FREE)
        if plan.admit:
            self._target().deadline = self._clock() + self._deployment.scale_timeout_s
            self._request_admission(None, m.RequestAdmission(WORLD, list(plan.admit)))
        if plan.remove:  # a withdrawn joiner's admission is withdrawn the same way
            self._request_deactivation(None, m.RequestDeactivation(WORLD, list(plan.remove)))
        op_id = op_id or ops.new_id()
        reply = {**plan.reply, "operation_id": op_id}
        superseded = ops.superseding(states)
        if superseded:  # grows that will never finish as asked: say so, not time them
            reply["superseded"] = superseded
        ops.add(Operation(op_id, request, tuple(sorted(plan.reply["slots"])),
                          leaving=not plan.admit, reply=reply), states)
        log.info("coordinator: epoch %d: operation %s %s: ep_size %d: %s", epoch, op_id,
                 request, self._target().ep_size, plan.reply)
        return reply

    @handles(m.GetOperation)
    def _get_operation(self, sup, msg: m.GetOperation) -> dict:
        op = self._deployment.operations.get(msg.operation_id)
        _epoch, states, ranks = self._world_view()
        if states is None:
            states = [SlotState.FREE] * self._target().max_ep_size
        procs = self._proc_infos()
        launches = self._deployment.live_launches()
        # a registered process, or a launched worker that has not registered yet
        alive = {s: (procs[r].alive if r in procs else False)
                 or (r in launches and (r not in procs or launches[r].pid != procs[r].pid))
                 for s, r in enumerate(ranks)}
        ops = self._deployment.operations
        return {"operation": op_view(op, states, alive, op.id in ops.timed_out,
                                     op.id in ops.superseded)}

    def _expire_scale(self, now: float) -> None:
        """A grow still waiting for joiners past ``--elastic-ep-scale-timeout`` gives up:
        its slots not admitted are freed, and its operation reads ``timed_out``."""
        target = self._deployment.target
        _epoch, states, _ranks = self._world_view() if target else (0, None, [])
        if target is None or states is None:
            return
        plan = target.give_up(now, states)
        if plan is None:
            return
        self._request_deactivation(None, m.RequestDeactivation(WORLD, list(plan.remove)))
        ops = self._deployment.operations
        for op in ops.ops.values():
            if not op.leaving and set(op.slots) & set(plan.remove):
                ops.timed_out.add(op.id)

    @handles(m.RecordLaunch, Role.SUPERVISOR)
    def _record_launch(self, sup, msg: m.RecordLaunch) -> dict:
        self._deployment.record_launch(sup.id, msg.rank, msg.node, msg.pid)
        return {}

    @handles(m.ClearLaunch, Role.SUPERVISOR)
    def _clear_launch(self, sup, msg: m.ClearLaunch) -> dict:
        self._deployment.clear_launch(msg.rank, msg.pid)
        return {}

    @handles(m.Reserve, Role.SUPERVISOR)
    def _reserve(self, sup, msg: m.Reserve) -> dict:
        """Check the slots for a join of ``mode`` and claim them, both or neither."""
        _epoch, states, ranks = self._world_view()
        if states is None:
            raise JoinRefusedError("the deployment has no ranks yet; wait for serve's "
                                   "ready line")
        self._deployment.reserve(sup.id, msg.who, msg.ranks)
        try:
            check_join(msg.mode, msg.ranks, states, ranks, self._target(),
                       self._proc_infos(), self._deployment.live_launches())
        except JoinRefusedError:
            self._deployment.release(sup.id, msg.ranks)
            raise
        if msg.mode == "recover":  # a retired slot comes back into the target in place
            for r in msg.ranks:
                if r in self._target().retired:
                    self._target().readmit(r)
        return {"ep_size": self._target().ep_size}

    @handles(m.Release, Role.SUPERVISOR)
    def _release(self, sup, msg: m.Release) -> dict:
        self._deployment.release(sup.id, msg.ranks)
        return {}

