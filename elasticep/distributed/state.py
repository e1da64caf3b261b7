"""Rank-side state of one elastic group: sequence numbers, kept results, epochs.

Consistency protocol (see `elasticep.membership.transitions` for the decision itself):

* Every collective takes the next sequence number ``seq``. Its inner op runs on the
  inner Gloo group of the epoch that covers ``seq`` (`EpochLog.covering`).
* While an announced transition is not committed, the main thread neither starts an op
  nor marks one completed, so the report sent by the control thread stays true.
* A failure decision committed after an op started makes that op re-evaluate:
  its inner work is abandoned (the inner group is reaped later) and `local_action`
  says fetch / run / raise.
* Completed ops of fetchable kinds keep their result (last `op_run.KEEP` ops) so that a
  survivor that missed the op can take it from a donor through the store.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import torch
import torch.distributed as dist

from elasticep.membership import errors
from elasticep.membership import messages as m
from elasticep.membership.transitions import (
    Decision,
    OnFailure,
    SlotState,
    TransitionKind,
)

from . import kept
from .epoch_groups import EpochComms, Superseded
from .epoch_log import EpochLog
from .nccl_inner import NcclComm
from .op_injection import NO_FAULTS, OpInjector
from .op_run import OpRun
from .p2p import PeerChannels, PeerGroup

log = logging.getLogger(__name__)
_A2A_OPTS = dist.AllToAllOptions()
_FAST_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16, torch.float64,
                          torch.int32, torch.int64, torch.uint8, torch.int8})


class GroupState(OpRun):
    """Per-group state shared by the main thread and the control thread.

    Args:
        ctl: the process's RankControl; store: client of the coordinator's TCPStore;
        new_store: makes another client of it (one per inner-group rendezvous).
        name: the group's unique name; slot: this rank's slot; ranks: global rank per slot.
        reg: the coordinator's answer to `Register` (epoch, active, states, on_failure).
        mask: caller-owned int32 tensor [max_group_size] kept equal to the active mask.
        timeout_s: bound of every blocking wait (seconds).
        on_close: called once by `close` (the owner's bookkeeping of shut-down groups).
    """

    def __init__(self, ctl, store, name: str, slot: int, ranks: list[int], reg: m.Reply,
                 mask: torch.Tensor, timeout_s: float, joining: bool, new_store,
                 on_close=None) -> None:
        self.ctl, self.store, self.name, self.slot, self.ranks = ctl, store, name, slot, ranks
        self.new_store, self._on_close = new_store, on_close
        self.closed = False
        self.on_failure: OnFailure = reg.typed("on_failure", OnFailure)
        self.timeout_s = timeout_s
        self.cond = threading.Condition()
        self.epoch: int = reg["epoch"]
        self.active: tuple[int, ...] = tuple(reg["active"])
        self.states: list[SlotState] = reg.typed("states", list[SlotState])
        self.requests: dict = {"admit": [], "remove": []}
        self.mask = mask
        self._set_mask()
        self.next_seq, self.last, self.started = 0, -1, -1
        self.kept: OrderedDict[int, list[torch.Tensor]] = OrderedDict()
        self.pending: int | None = None
        self.failure: Decision | None = None
        self.failure_gen = 0
        self.removed_at: int | None = None
        self.declared_dead = False
        self.joined = not joining
        self.epochs = EpochLog(self.epoch, self.active)
        self.comms = EpochComms(self)  # every epoch's inner groups
        # called between an op's result and its completion (op_injection: tests only)
        self.injector: OpInjector = NO_FAULTS
        self._used_epoch = self.epoch
        # Set by the first CUDA op: from then on every epoch's inner group also builds
        # its NCCL communicator as soon as the epoch commits (overlapping the decision).
        self.cuda_device: torch.device | None = None
        # The communicator stream-ordered all_to_alls may use without `run`'s bookkeeping
        # (see `fast_all_to_all`); any announce or commit clears it.
        self._fast: NcclComm | None = None
        # ops by route, for benchmarks and logs: fast (fast_all_to_all launched it),
        # run (went through `run`), lease_confirms (a coordinator round trip in `run`)
        self.counters = {"fast": 0, "run": 0, "solo": 0, "lease_confirms": 0}
        # called (on the control thread, no lock held) when a change is announced or a
        # failure decision arrives: see `api.add_change_listener`
        self.change_listeners: list[Callable[[], None]] = []
        self.peers = PeerChannels(PeerGroup(  # send/recv
            name, slot, len(ranks), timeout_s, ctl.local_addr, store, new_store, self.epochs,
            self.check_member, self.check_alive, lambda s: self.states[s]))
        if self.joined and slot in self.active:
            self.comms.for_epoch(self.epoch, self.active)

    # ------------------------------------------------------------------ control thread
    def on_push(self, msg: m.GroupPush) -> None:
        """Apply a push of the coordinator for this group (on the control thread)."""
        if isinstance(msg, m.Announce):
            with self.cond:
                self.pending, self._fast = msg.epoch, None
                started = self.started
                if self.failure is not None:
                    # Ops up to the pivot belong to the unapplied failure decision, so a
                    # change boundary must lie after it (the raise case jumps to base).
                    started = max(started, self.failure.last + 1)
                report = m.EpochReport(self.name, msg.epoch, self.last, started,
                                       list(self.kept))
            try:
                self.ctl.send(report)
            finally:  # a watcher learns of the change even if the report is not sent
                self._changed()
        elif isinstance(msg, m.Commit):
            with self.cond:
                self.requests = msg.requests
            self._on_commit(msg.decision, msg.states)
        else:
            with self.cond:
                self.states, self.requests = list(msg.states), msg.requests
                self.cond.notify_all()

    def _on_commit(self, d: Decision, states: list[SlotState]) -> None:
        publish = []
        with self.cond:
            was_member = self.joined and self.slot in self.active
            if self.pending is not None and self.pending <= d.epoch:
                self.pending = None
            self._fast = None
            self.epoch, self.active, self.states = d.epoch, d.active, list(states)
            self._set_mask()
            parent = (self.comms.shrink_parent(d) if was_member and self.slot in d.active
                      else None)
            if d.kind == TransitionKind.FAILURE and was_member:
                # (A relaunched process for a dead slot is not a member: never evict it.)
                if self.slot in d.dead:
                    self.declared_dead = True
                self.failure = d
                # A survivor's NCCL kernel with a dead peer never ends: abort it now, off
                # this thread, while the next epoch's communicator is being built (the
                # one the next epoch shrinks, if any, is aborted by that shrink).
                self.comms.abort_below(d.epoch, keep=parent)
                self.failure_gen += 1
                publish = [(s, self.kept[s]) for s, donor in d.donors.items()
                           if donor == self.slot and s in self.kept]
            elif was_member and self.slot not in d.active:
                self.removed_at = d.boundary
            elif not was_member and self.slot in d.active and not self.joined:
                self.joined = True
                self.next_seq, self.last, self.started = d.boundary, d.boundary - 1, d.boundary - 1
            self.epochs.add(d.boundary, d.epoch, d.active)
            self.cond.notify_all()
        log.info("epoch %d rank %d group %s: commit %s active=%s", d.epoch, self.slot,
                 self.name, d.kind, list(d.active))
        if d.kind == TransitionKind.FAILURE:
            self._changed()
        for seq, result in publish:
            kept.publish(self.store, kept.key(self.name, d.epoch, seq), result)
        if self.joined and self.slot in d.active:
            self.comms.for_epoch(d.epoch, d.active)

    def _changed(self) -> None:
        for fn in list(self.change_listeners):
            try:
                fn()
            except Exception:  # a listener's bug must not stop the control thread
                log.exception("group %s: a change listener raised", self.name)

    def on_lost(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def on_resumed(self) -> None:
        """The control connection moved to a new leader, whose rendezvous TCPStore is
        another: keep results and p2p tokens there from now on (control thread). The
        inner groups already built need no store; later epochs' use ``new_store``,
        which follows the connection."""
        store = self.new_store()
        with self.cond:
            self.store = store
        self.peers.rebase(store)

    # ------------------------------------------------------------------ main thread
    # (one collective through `run`: see op_run.OpRun)
    def fast_all_to_all(self, output: torch.Tensor, input: torch.Tensor,
                        out_splits: list[int], in_splits: list[int]):
        """Launch a stream-ordered CUDA all_to_all_single with none of `run`'s per-op
        Python work, when that is sound; else return None (the caller uses `run`).

        Sound when the last op already ran stream-ordered on the NCCL communicator of
        the current epoch with every slot active, and no transition was announced or
        committed since (either clears the cache under the lock this takes too). The op
        still takes its sequence number, so the consistency protocol sees it exactly as
        it sees a stream-ordered op of `run`: started and completed at launch.

        Args:
            output, input: contiguous CUDA tensors of one dtype on the group's device;
                dim0 split over the slots (``out_splits``/``in_splits``: rows per slot,
                or empty for even splits).
        Returns:
            The NCCL Work (its ``wait()`` orders the caller's stream after the op), or None.
        """
        # Every check here is a C-level call or an attribute read: this runs per op.
        comm = self._fast
        if (comm is None or output.dtype not in _FAST_DTYPES or input.dtype != output.dtype
                or output.get_device() != comm.device.index or not self.ctl.lease_fresh()
                or not (output.is_contiguous() and input.is_contiguous())):
            return None
        self.cond.acquire()
        try:
            if self._fast is not comm or self.ctl.evicted or self.ctl.lost:
                return None
            seq = self.started = self.next_seq
            work = comm.pg.alltoall_base(output, input, out_splits, in_splits, _A2A_OPTS)
            comm.last_work = work
            self.last, self.next_seq = seq, seq + 1
            self.counters["fast"] += 1
        finally:
            self.cond.release()
        return work

    def check_member(self, what: str) -> None:
        """Raise ValueError if this rank cannot run `what` on the group yet (or any more)."""
        if self.closed:
            raise ValueError(f"group {self.name!r} was destroyed on rank {self.slot}; "
                             f"{what} needs a live group")
        if not self.joined:
            raise ValueError(f"rank {self.slot} has not joined group {self.name!r} yet: call "
                             f"join_group and wait for admission before {what}")

    def close(self) -> None:
        """This rank leaves the group (destroyed): pushes for it are dropped from now on,
        its inner groups are handed to the reaper, `on_close` runs once."""
        with self.cond:
            if self.closed:
                return
            self.closed = True
            self.cond.notify_all()
        self.ctl.detach(self.name)
        self.peers.close()
        self.comms.reap_below(1 << 62)  # every epoch
        if self._on_close is not None:
            self._on_close()

    def join(self, timeout_s: float) -> None:
        """Block until this (extension) rank is admitted. Raises TimeoutError."""
        self.wait_until(lambda: self.joined, timeout_s, "admission of this joiner")

    def wait_until(self, pred, timeout_s: float, what: str) -> None:
        """Block until pred() (evaluated under the lock) holds. Raises TimeoutError."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while not pred():
                self.check_alive()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"rank {self.slot} group {self.name!r}: {what} did not "
                                       f"happen within {timeout_s}s (epoch {self.epoch})")
                self.cond.wait(min(left, 0.05))

    # ------------------------------------------------------------------ helpers
    def check_alive(self) -> None:
        """Raise RankEvictedError (this rank was evicted or declared failed) or
        CoordinatorLostError (the control connection broke); call with the lock held."""
        if self.declared_dead or self.ctl.evicted:
            raise errors.RankEvictedError(f"rank {self.slot} of {self.name!r} was evicted "
                                   f"({self.ctl.evicted or 'declared failed'}); epoch {self.epoch}")
        if self.ctl.lost:
            raise errors.CoordinatorLostError(f"rank {self.slot} of {self.name!r}: "
                                       f"{self.ctl.lost_reason}; epoch {self.epoch}")

    def _wait_quiet(self, deadline: float) -> None:
        """Wait (lock held) until no transition is pending. Raises on eviction/timeout."""
        while True:
            self.check_alive()
            if self.pending is None:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"rank {self.slot} group {self.name!r}: epoch "
                                   f"{self.pending} not committed in time")
            self.cond.wait(min(left, 0.05))

    def check_gen(self, gen: int) -> None:
        """Raise as `check_alive` does, or `Superseded` if a failure decision newer than
        ``gen`` (a `failure_gen` value) arrived."""
        with self.cond:
            self.check_alive()
            if self.failure_gen != gen:
                raise Superseded

    def _set_mask(self) -> None:
        m = torch.zeros(self.mask.numel(), dtype=self.mask.dtype)
        m[list(self.active)] = 1
        self.mask.copy_(m)
