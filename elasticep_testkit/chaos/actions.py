"""Carry out one fault of a schedule against a live deployment, and restore the
deployment to its healthy baseline afterwards.

Each action returns the invariant violations it saw itself (one line each); a bounded
wait that runs out raises :class:`TimeoutError`, which the runner records as a
violation (the deployment hung). Only pids read from ``/elastic_ep_status`` or started
here (joins and their descendants) are signalled.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from elasticep.membership.election import lease_ttl_s
from elasticep.membership.transitions import ACTIVE_STATES, ScalePhase, SlotState
from elasticep.utils.wait import wait_until
from elasticep_testkit.chaos.schedule import Fault
from elasticep_testkit.chaos.two_nodes import TwoNodes
from elasticep_testkit.harness.faults import resume, signal_ranks, wait_in, wait_out
from elasticep_testkit.harness.serve_process import ServeProcess, Status, descendant_pids
from elasticep_testkit.harness.status_watch import StatusWatch

logger = logging.getLogger(__name__)

DETECT_BOUND_S = 15.0  # a killed rank must leave the membership within this
JOIN_BOUND_S = 240.0  # a joiner loads the model on a shared 2-core machine


@dataclass
class Target:
    """The deployment under test.

    Attributes:
        serve, watch: the deployment and its coordinator watch.
        ep_size: the baseline number of healthy ranks (slots 0..ep_size-1).
        heartbeat_timeout_s: the deployment's heartbeat timeout.
        notes: remarks that are not violations (a refused scale, an early admission).
        nodes: the 2-node etcd deployment (``serve`` is then its node 1), or None.
    """

    serve: ServeProcess
    watch: StatusWatch
    ep_size: int
    heartbeat_timeout_s: float
    notes: list[str] = field(default_factory=list)
    nodes: TwoNodes | None = None

    def two_nodes(self, kind: str) -> TwoNodes:
        """The 2-node deployment ``kind`` needs.

        Raises:
            RuntimeError: this is a single-node deployment.
        """
        if self.nodes is None:
            raise RuntimeError(f"{kind} needs the 2-node deployment (--nnodes 2)")
        return self.nodes

    def state(self, rank: int, status: Status | None = None) -> SlotState:
        return self.serve.rank_state(rank, status).state

    def kill(self, *ranks: int, gap_s: float = 0.0) -> None:
        """SIGKILL the ranks' workers, ``gap_s`` seconds apart."""
        signal_ranks(self.serve, ranks, signal.SIGKILL, gap_s)

    def wait_out(self, ranks: tuple[int, ...], since: float) -> None:
        """Wait until the coordinator committed an epoch without ``ranks``."""
        wait_out(self.watch, ranks, since, DETECT_BOUND_S)


def kill(t: Target, f: Fault) -> list[str]:
    since = time.monotonic()
    t.kill(f.ranks[0])
    t.wait_out(f.ranks, since)
    return []


def double_kill(t: Target, f: Fault) -> list[str]:
    since = time.monotonic()
    t.kill(*f.ranks, gap_s=f.param_s)
    t.wait_out(f.ranks, since)
    return []


def kill_during_recovery(t: Target, f: Fault) -> list[str]:
    first, second = f.ranks
    since = time.monotonic()
    t.kill(first)
    # recovery starts when the coordinator marks the death; strike right then
    t.watch.wait_for(lambda s: s.states[first] != SlotState.HEALTHY, DETECT_BOUND_S,
                     f"rank {first} marked failed", after=since)
    time.sleep(f.param_s)
    t.kill(second)
    t.wait_out(f.ranks, since)
    return []


def freeze(t: Target, f: Fault) -> list[str]:
    rank = f.ranks[0]
    since = time.monotonic()
    (_, _, pid), = signal_ranks(t.serve, [rank], signal.SIGSTOP)
    time.sleep(f.param_s)
    evicted = rank not in t.watch.latest().active
    if f.param_s > t.heartbeat_timeout_s * 1.5 and not evicted:
        t.wait_out(f.ranks, since)  # eviction is due: it must come
        evicted = True
    # an evicted worker learns it on resume and must exit by itself
    if not resume(pid, 15.0 if evicted else 0.0) and evicted:
        t.notes.append(f"evicted rank {rank} (pid {pid}) still alive 15 s after SIGCONT")
    return []


def joiner_dies(t: Target, f: Fault) -> list[str]:
    rank = f.ranks[0]
    since = time.monotonic()
    t.kill(rank)
    t.wait_out(f.ranks, since)
    join = t.serve.join("--elastic-ep-join-mode", "recover", "--ranks", str(rank),
                        tag="joiner-dies")
    try:
        wait_until(lambda: descendant_pids(join.proc.pid) or join.proc.poll() is not None,
                   30.0, f"a worker of the join for rank {rank}")
    except TimeoutError:
        pass
    if not descendant_pids(join.proc.pid):
        return [f"joiner-dies: join for rank {rank} started no worker (exit "
                f"{join.proc.poll()}): {join.output()[-300:]!r}"]
    time.sleep(f.param_s)
    workers = descendant_pids(join.proc.pid)
    t.serve.seen_pids.update(workers)
    for pid in workers:  # the joining rank itself dies, then its supervisor
        _signal(pid, signal.SIGKILL)
    join.proc.kill()
    join.proc.wait(10)
    # the slot must fall back to failed (ready to be relaunched), never stay in limbo
    t.serve.wait_for(lambda st: t.state(rank, st) == SlotState.FAILED, 30.0,
                     f"rank {rank} back to failed after its joiner died")
    return []


def scale_while_failing(t: Target, f: Fault) -> list[str]:
    victim, slot = f.ranks[0], t.ep_size
    t.serve.join("--elastic-ep-join-mode", "scale", "--ranks", str(slot), tag=f"scale{slot}-")
    t.serve.wait_for(lambda st: t.state(slot, st) == SlotState.READY, JOIN_BOUND_S,
                     f"scale joiner of slot {slot} ready", poll_s=0.2)
    since = time.monotonic()
    t.kill(victim)
    time.sleep(f.param_s)
    code, body = t.serve.scale(t.ep_size + 1)
    message = str(body.get("error", {}).get("message", "")) if isinstance(body, dict) else ""
    if code in (400, 409) and message:
        t.notes.append(f"scale while rank {victim} failing refused clearly: {code} {message}")
    elif code != 200:
        return [f"scale while rank {victim} failing: POST -> {code} {body}"]
    t.wait_out((victim,), since)
    if code == 200:
        wait_in(t.watch, [slot], since, JOIN_BOUND_S)
    return []


def occupied_join(t: Target, f: Fault) -> list[str]:
    rank = f.ranks[0]
    before = t.serve.rank_state(rank)
    if before.state != SlotState.HEALTHY:
        t.notes.append(f"occupied-join skipped: rank {rank} is {before.state}")
        return []
    join = t.serve.join("--elastic-ep-join-mode", "recover", "--ranks", str(rank),
                        tag="occupied")
    try:
        code = join.proc.wait(60)
    except subprocess.TimeoutExpired:
        join.proc.kill()
        return [f"join for occupied rank {rank} neither refused nor exited within 60 s"]
    text = join.output()
    after = t.serve.rank_state(rank)
    out = []
    if code == 0 or "error" not in text or f"rank {rank}" not in text:
        out.append(f"join for occupied rank {rank}: exit {code}, no clear error: {text[-300:]!r}")
    if after.pid != before.pid or after.state != SlotState.HEALTHY:
        out.append(f"join for occupied rank {rank} disturbed it: {before} -> {after}")
    return out


def leader_kill(t: Target, f: Fault) -> list[str]:
    """SIGKILL the leading replica: a standby must lead within ``DETECT_BOUND_S``, and
    the ranks resume with it in place: the same epoch, the same healthy ranks in the
    same processes. A new leader later than the issue's target (the lease TTL and a
    second) is a note: on a loaded machine etcd's lease expiry runs late too."""
    nodes = t.two_nodes(f.kind)
    old, pid = nodes.leader_pid()
    before, pids = t.watch.latest(), t.serve.status().pids()
    target = lease_ttl_s(t.heartbeat_timeout_s) + 1.0
    _signal(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    wait_until(lambda: nodes.leader() not in (None, old), DETECT_BOUND_S,
               "a new leader after the leader kill", poll_s=0.05)
    took = time.monotonic() - killed_at
    if took > target:
        t.notes.append(f"leader-kill: a new leader after {took:.2f} s (target: lease TTL "
                       f"+ 1 s = {target:g} s)")
    st = t.serve.wait_for(lambda st: st.membership_store is not None
                          and st.membership_store.leader not in (None, old)
                          and st.healthy_ranks() == list(before.active), DETECT_BOUND_S,
                          "the ranks to resume with the new leader", poll_s=0.1)
    out = []
    if t.watch.latest().epoch != before.epoch:
        out.append(f"leader-kill: epoch {before.epoch} -> {t.watch.latest().epoch} (the "
                   "ranks should resume in place)")
    if st.pids() != pids:
        out.append(f"leader-kill: rank processes changed: {pids} -> {st.pids()}")
    return out


def node0_host_kill(t: Target, f: Fault) -> list[str]:
    """SIGKILL every process of node 0; the survivors commit an epoch without node 0's
    ranks; then node 0's `serve` is started again and its ranks are readmitted."""
    nodes = t.two_nodes(f.kind)
    since = time.monotonic()
    nodes.kill_node0()
    t.wait_out(f.ranks, since)
    back = nodes.restart_node0()
    out = [] if "this node 0 takes its slots back" in back.tail() else [
        f"node-0-host-kill: node 0's serve did not take its slots back: {back.tail()[-300:]!r}"]
    wait_in(t.watch, list(f.ranks), since, JOIN_BOUND_S)
    return out


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass  # already gone: what we wanted


ACTIONS: dict[str, Callable[[Target, Fault], list[str]]] = {
    "kill": kill, "freeze": freeze, "double-kill": double_kill,
    "kill-during-recovery": kill_during_recovery, "joiner-dies": joiner_dies,
    "scale-while-failing": scale_while_failing, "occupied-join": occupied_join,
    "leader-kill": leader_kill, "node-0-host-kill": node0_host_kill,
}


def restore(t: Target) -> None:
    """Bring the deployment back to slots 0..ep_size-1 healthy, nothing else active,
    scale phase idle: relaunch failed slots with `join recover` (again if a joiner
    exits before its slot is healthy), then scale back down.

    Raises:
        TimeoutError: a bounded wait ran out (the deployment could not be restored).
        RuntimeError: serve exited, or a scale request was refused.
    """
    base = range(t.ep_size)
    joiners: dict[int, subprocess.Popen] = {}

    def relaunch_failed(st: Status) -> bool:
        # decide on a status that has caught up with the coordinator: the front-end's
        # view may lag it by one poll
        if st.epoch < t.watch.latest().epoch:
            return False
        for r in base:
            if (t.state(r, st) == SlotState.FAILED
                    and (r not in joiners or joiners[r].poll() is not None)):
                logger.info("restore: relaunching rank %d", r)
                joiners[r] = t.serve.join("--elastic-ep-join-mode", "recover", "--ranks",
                                          str(r), tag="restore").proc
        return all(t.state(r, st) == SlotState.HEALTHY for r in base)

    st = t.serve.wait_for(relaunch_failed, JOIN_BOUND_S, "failed slots relaunched", poll_s=0.2)
    _end_unadmitted_scale_joiners(t, st)
    if st.ep_size != t.ep_size or any(r.state in ACTIVE_STATES
                                      for r in st.ranks if r.rank >= t.ep_size):
        t.serve.wait_for(lambda s: s.scale_phase == ScalePhase.IDLE, JOIN_BOUND_S,
                         "a running scale to finish", poll_s=0.2)
        logger.info("restore: scaling back to %d", t.ep_size)
        code, body = t.serve.scale(t.ep_size)
        if code != 200:
            raise RuntimeError(f"restore: POST /scale_elastic_ep {t.ep_size} -> {code} {body}")
    t.serve.wait_for(lambda s: s.scale_phase == ScalePhase.IDLE and s.ep_size == t.ep_size
                     and s.healthy_ranks() == list(base),
                     JOIN_BOUND_S, "baseline restored", poll_s=0.2)


def _end_unadmitted_scale_joiners(t: Target, status: Status) -> None:
    """SIGTERM our scale joiners whose slot was never admitted (a refused scale), so the
    slot is free for the next trial."""
    for rank in range(t.ep_size, len(status.ranks)):
        if t.state(rank, status) in (SlotState.READY, SlotState.JOINING):
            for p in t.serve.joins:
                if p.poll() is None and f"--ranks {rank}" in " ".join(map(str, p.args)):
                    p.terminate()
                    p.wait(15)
            t.serve.wait_for(lambda s, r=rank: t.state(r, s) in (SlotState.FREE,
                                                                  SlotState.FAILED), 30.0,
                             f"unadmitted slot {rank} freed")
