"""The main thread's half of an elastic group's state: one collective, consistently.

:meth:`OpRun.run` is a retry loop over three phases: :meth:`~OpRun._begin` (under the
lock, once no transition is pending: the op's sequence number, its epoch, and this
rank's action under the failure decision in force, or the raise that decision asks
for), :meth:`~OpRun._execute` (fetch the kept result from a donor, or run the op on
its epoch's inner group) and :meth:`~OpRun._complete` (mark it completed unless a
decision counted it as not; confirm a stale lease first). A failure decision that
overtakes an op sends it back to the first phase.

:class:`OpRun` is a base of :class:`~elasticep.distributed.state.GroupState`: it reads
and writes that state's fields (``cond``, ``next_seq``, ``failure``, ``epochs``,
``comms``, ``kept``, ...) under its lock; the control thread's half (pushes, commits)
is the state's own.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import timedelta

import torch

from elasticep.membership import errors
from elasticep.membership.transitions import Decision, OnFailure, OpAction, local_action

from . import kept, nccl_inner
from .epoch_groups import Superseded
from .nccl_inner import NcclComm, cuda_device_of, wait_cuda_work
from .solo import SOLO

log = logging.getLogger("elasticep.distributed.state")
KEEP = 4  # completed fetchable ops whose results a member keeps for its survivors
SLICE = timedelta(milliseconds=50)


@dataclass
class _Ticket:
    """One attempt at a collective, from :meth:`OpRun._begin` to :meth:`OpRun._complete`.

    Attributes:
        seq: its sequence number; action: run or fetch (``OpAction``); decision: the
        failure decision in force at its start (None: none); gen: ``failure_gen`` then;
        epoch, active: the epoch covering ``seq`` and its active slots; dev, comm: the
        CUDA device and NCCL communicator it ran on (None: a CPU op or a fetch).
    """

    seq: int
    action: OpAction
    decision: Decision | None
    gen: int
    epoch: int
    active: tuple[int, ...]
    dev: torch.device | None = None
    comm: NcclComm | None = None


class OpRun:
    """One collective at a time, consistently (see the module doc); a base of
    :class:`~elasticep.distributed.state.GroupState`."""

    def run(self, op) -> None:
        """Execute one collective `op` (an `ops.Op`) consistently; see module docstring.

        Three phases, retried from the first when a failure decision overtakes the op:
        :meth:`_begin` takes its sequence number and decides what this rank does
        (run, fetch from a donor, or raise), :meth:`_execute` does it, and
        :meth:`_complete` marks it completed unless a decision counted it as not.

        Raises:
            RankFailureError: ranks died and this op cannot be completed consistently.
            RankEvictedError / RankRemovedError: this rank is no longer a member.
            TimeoutError: no progress within timeout_s.
        """
        deadline = time.monotonic() + self.timeout_s
        self.counters["run"] += 1
        self.check_member(op.kind)
        while True:
            t = self._begin(op, deadline)
            try:
                result = self._execute(op, t, deadline)
            except Superseded:
                continue
            if self._complete(op, t, result, deadline):
                op.apply(result)
                return

    def _begin(self, op, deadline: float) -> _Ticket:
        """Under the lock, once no transition is pending: the op's sequence number, its
        epoch, and this rank's action under the failure decision in force (if any).
        Raises RankRemovedError, or RankFailureError where the decision says raise."""
        with self.cond:
            self._wait_quiet(deadline)
            seq = self.next_seq
            if self.removed_at is not None and seq >= self.removed_at:
                raise errors.RankRemovedError(f"rank {self.slot} removed from {self.name!r}")
            action, d = OpAction.RUN, self.failure
            if d is not None:
                action = local_action(d, seq, op.fetchable, op.redoable(self.epochs.covering(
                    seq)[1]), self.on_failure)
                if action in (OpAction.DONE, OpAction.RUN):
                    self.failure, action = None, OpAction.RUN
                elif action == OpAction.RAISE:
                    self.failure = None
                    self.next_seq, self.last, self.started = d.base, d.base - 1, d.base - 1
                    self.kept.clear()
                    log.warning("epoch %d rank %d group %s: op %d (%s) raises", d.epoch,
                                self.slot, self.name, seq, op.kind)
                    raise errors.RankFailureError(list(d.dead), d.epoch, self.name)
            self.started = seq
            epoch, active = self.epochs.covering(seq)
            return _Ticket(seq, action, d, self.failure_gen, epoch, active)

    def _execute(self, op, t: _Ticket, deadline: float):
        """Fetch the op's kept result from its donor, or run it on the inner group of its
        epoch (Gloo, or NCCL for CUDA tensors); returns what ``op.apply`` takes. Raises
        Superseded when a newer failure decision abandons it."""
        if t.action == OpAction.FETCH:
            return kept.fetch(self.store, kept.key(self.name, t.decision.epoch, t.seq),
                              lambda g=t.gen: self.check_gen(g), deadline,
                              f"rank {self.slot}: kept result of op {t.seq}")
        if t.epoch != self._used_epoch:  # first op of a new epoch on this rank
            self.comms.reap_below(t.epoch)
            self._used_epoch = t.epoch
        inner = self.comms.ready(t.epoch)  # fast path: built and ready
        if inner is None:
            inner = self.comms.for_epoch(t.epoch, t.active).get(self, t.gen, deadline)
        t.dev = cuda_device_of(op)
        if t.dev is None:
            solo = len(t.active) == 1  # the op's data movement is local (solo.py)
            self.counters["solo"] += solo
            work, finalize = op.start(SOLO if solo else inner.pg, t.active)
            inner.last_work = work
            self._wait_work(work, t.gen, deadline)
        else:
            t.comm = inner.cuda(self, t.dev, t.gen, deadline)
            work, finalize = op.start(t.comm.pg, t.active)
            t.comm.last_work = work
            if self._stream_ordered(op):
                work.wait()  # stream-ordered: no host wait (see nccl_inner)
            else:
                wait_cuda_work(work, lambda g=t.gen: self.check_gen(g), deadline,
                               f"rank {self.slot} group {self.name!r} op {t.seq}")
        result = finalize()
        self.injector.before_complete(t.seq)
        return result

    def _complete(self, op, t: _Ticket, result, deadline: float) -> bool:
        """Mark the op completed (and keep a fetchable result for survivors that missed
        it); False when a failure decision arrived meanwhile and counted it as not
        completed, so the caller begins it again. A stale lease is confirmed with the
        coordinator first."""
        with self.cond:
            self._wait_quiet(deadline)
            if self.failure_gen != t.gen:
                return False  # the decision counted this op as not completed
            if not self.ctl.lease_fresh():
                self.counters["lease_confirms"] += 1
                # unlocked: the control thread may need the lock meanwhile (a push),
                # and a stalled coordinator can make this wait long (control.py)
                self.cond.release()
                try:
                    self.ctl.confirm_membership()
                finally:
                    self.cond.acquire()
                self._wait_quiet(deadline)
                if self.failure_gen != t.gen:
                    return False  # a decision arrived while we confirmed: as above
            self.last, self.next_seq = t.seq, t.seq + 1
            if (t.dev is not None and t.action == OpAction.RUN and t.epoch == self.epoch
                    and len(t.active) == len(self.ranks) and self._stream_ordered(op)):
                self._fast = t.comm
            if op.fetchable:
                self.kept[t.seq] = result  # private buffers: no copy needed
                while len(self.kept) > KEEP:
                    self.kept.popitem(last=False)
        return True

    def _stream_ordered(self, op) -> bool:
        """True if a CUDA `op` is waited on by the caller's stream, not the host."""
        return (not op.fetchable and self.on_failure == OnFailure.RAISE
                and nccl_inner.ASYNC_UNFETCHABLE)

    def _wait_work(self, work, gen: int, deadline: float) -> None:
        while True:
            try:
                work.wait(SLICE)
                return
            except Exception:
                errored = work.is_completed()
            self.check_gen(gen)
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.slot} group {self.name!r}: op timed out "
                                   f"(epoch {self.epoch})")
            if errored:  # the inner group broke: wait for the coordinator's decision
                with self.cond:
                    self.cond.wait(0.05)
