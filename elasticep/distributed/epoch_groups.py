"""The inner groups of one epoch of an elastic group: its ProcessGroupGloo and, for CUDA
tensors, its NCCL communicator (`nccl_inner.NcclComm`); and `EpochComms`, the set of
them over a group's epochs on this rank.

Both are built on background threads as soon as the epoch commits (the NCCL one once
the group has seen a CUDA op), so that the first op of a new epoch rarely waits. The
owner (`state.GroupState`) is passed in, not imported at run time: this module sits
below it.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .gloo_device import new_gloo_group
from .nccl_inner import NcclComm
from .reaper import reap

if TYPE_CHECKING:  # the owner, for type hints only (it imports this module)
    from elasticep.membership.transitions import Decision

    from .state import GroupState


class Superseded(Exception):
    """A newer failure decision arrived while waiting; the op must be re-evaluated."""


class EpochGroups:
    """The inner groups of one epoch: a ProcessGroupGloo, built on a background thread,
    and (for CUDA tensors) an `NcclComm`, built on first use or, once the group has
    seen a CUDA op, as soon as the epoch commits."""

    def __init__(self, gs: GroupState, epoch: int, active: tuple[int, ...]) -> None:
        self.epoch, self.pg, self.error = epoch, None, None
        self.active = active
        self.last_work = None
        self.nccl: NcclComm | None = None
        self.ready = threading.Event()
        prefix = f"elastic/{gs.name}/e{epoch}/"
        self._prefix = prefix
        rank, size = active.index(gs.slot), len(active)
        timeout = timedelta(seconds=gs.timeout_s)
        if gs.cuda_device is not None:
            self._start_nccl(gs, gs.cuda_device)

        def build() -> None:
            try:
                # A store client of its own: TCPStore clients serialise requests, and a
                # rendezvous blocked on a dead member must not stall the next epoch's.
                store = gs.new_store()
                self.pg = new_gloo_group(dist.PrefixStore(prefix, store), rank, size,
                                         timeout, gs.ctl.local_addr)
            except Exception as e:  # a member died during rendezvous; a new epoch follows
                self.error = e
            self.ready.set()

        threading.Thread(target=build, daemon=True, name=f"elastic-inner-{gs.name}-e{epoch}"
                         ).start()

    def get(self, gs: GroupState, gen: int, deadline: float):
        while not self.ready.wait(0.05):
            gs.check_gen(gen)
            if time.monotonic() > deadline:
                raise TimeoutError(f"inner group of epoch {self.epoch} not built in time")
        if self.pg is None:
            self._await_next_failure(gs, gen, deadline, f"inner group failed: {self.error}")
        return self

    def _await_next_failure(self, gs: GroupState, gen: int, deadline: float, why: str) -> None:
        """A member died during rendezvous: block until the failure decision that replaces
        this epoch arrives, then raise Superseded (TimeoutError past ``deadline``)."""
        with gs.cond:
            while gs.failure_gen == gen:
                gs.check_alive()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"epoch {self.epoch}: {why}")
                gs.cond.wait(0.05)
        raise Superseded

    def _start_nccl(self, gs: GroupState, device: torch.device) -> NcclComm:
        parent, excluded = gs.comms.take_shrink(self.epoch)
        self.nccl = NcclComm(gs.new_store, self._prefix + "nccl/", self.active.index(gs.slot),
                             len(self.active), device, gs.timeout_s, parent, excluded)
        gs.comms.nccl[self.epoch] = self.nccl
        return self.nccl

    def cuda(self, gs: GroupState, device: torch.device, gen: int, deadline: float) -> NcclComm:
        """This epoch's NCCL communicator, ready (built on first use).

        Raises:
            Superseded: a newer failure decision arrived while waiting.
            ValueError: the group's CUDA ops moved to another device.
            TimeoutError: not built by `deadline`.
        """
        comm = self.nccl
        if comm is not None and comm.ready.is_set() and comm.pg is not None:
            if comm.device != device:
                raise ValueError(f"group {gs.name!r}: CUDA ops on {device}, communicator on "
                                 f"{comm.device}")
            return comm
        with gs.cond:
            if gs.cuda_device is None:
                gs.cuda_device = device
            comm = self.nccl or self._start_nccl(gs, device)
        while not comm.ready.wait(0.002):
            gs.check_gen(gen)
            if time.monotonic() > deadline:
                raise TimeoutError(f"nccl communicator of epoch {self.epoch} not built in time")
        if comm.pg is None or comm.error is not None:
            self._await_next_failure(gs, gen, deadline,
                                     f"nccl communicator failed: {comm.error}")
        return comm

    def reapable(self) -> bool:
        """True once no op of this epoch can still be running (or its comm is aborted)."""
        w = self.last_work
        return (w is None or w.is_completed()) and (self.nccl is None or self.nccl.idle())

    def close(self) -> None:
        """Release both inner groups and the last work (reaper thread only: may block)."""
        if self.nccl is not None:
            self.nccl.close()
        self.pg = self.last_work = None


class EpochComms:
    """The communicators of one group's epochs on this rank: each epoch's
    :class:`EpochGroups` (built once, reaped when no op of this rank uses it any more),
    the NCCL communicator an epoch shrinks from, and every NCCL communicator built (kept
    for their timings).

    Every method takes the group's lock itself, except where it says the lock is held.

    Args:
        gs: the group whose epochs these are.
    """

    def __init__(self, gs: GroupState) -> None:
        self._gs = gs
        self._inner: dict[int, EpochGroups] = {}
        self.nccl: dict[int, NcclComm] = {}  # epoch -> comm (released ones kept for timings)
        # epoch -> (previous epoch's communicator, its ranks that left): to shrink
        self._shrink_from: dict[int, tuple[NcclComm, list[int]]] = {}

    def for_epoch(self, epoch: int, active: tuple[int, ...]) -> EpochGroups:
        """The inner groups of ``epoch`` (slots ``active``), started now if new."""
        with self._gs.cond:
            inner = self._inner.get(epoch)
            if inner is None:
                inner = EpochGroups(self._gs, epoch, active)
                self._inner[epoch] = inner
            return inner

    def ready(self, epoch: int) -> EpochGroups | None:
        """The inner groups of ``epoch`` if their Gloo group is built, else None."""
        inner = self._inner.get(epoch)
        if inner is None or not inner.ready.is_set() or inner.pg is None:
            return None
        return inner

    def shrink_parent(self, d: Decision) -> NcclComm | None:
        """The newest earlier epoch's communicator if `d` only removes members (lock held);
        recorded so that `d`'s epoch shrinks it instead of building a fresh one."""
        prev = max((e for e in self._inner if e < d.epoch), default=None)
        inner = self._inner.get(prev) if prev is not None else None
        if inner is None or inner.nccl is None or not set(d.active) < set(inner.active):
            return None
        self._shrink_from[d.epoch] = (inner.nccl, [i for i, s in enumerate(inner.active)
                                                   if s not in d.active])
        return inner.nccl

    def take_shrink(self, epoch: int) -> tuple[NcclComm | None, list[int] | None]:
        """(the communicator ``epoch`` shrinks, the ranks of it that left), or Nones."""
        return self._shrink_from.pop(epoch, (None, None))

    def abort_below(self, epoch: int, keep: NcclComm | None) -> None:
        """Abort, off this thread, every busy NCCL communicator of the epochs before
        ``epoch`` but ``keep`` (lock held): a kernel with a dead peer never ends."""
        for e, inner in self._inner.items():
            if (e < epoch and inner.nccl is not None and inner.nccl is not keep
                    and not inner.nccl.idle()):
                inner.nccl.abort_async()

    def reap_below(self, epoch: int) -> None:
        """Hand inner groups older than `epoch` (no longer used by this rank) to the reaper."""
        with self._gs.cond:
            old = [self._inner.pop(e) for e in list(self._inner) if e < epoch]
        for inner in old:
            reap(inner)

    def nccl_timings(self) -> dict[int, dict]:
        """Per epoch: seconds to build + warm its NCCL comm, and to abort it (None: not),
        and how it was built ("shrink" of the previous epoch's, or "init")."""
        return {e: {"built_s": c.built_s, "abort_s": c.abort_s, "aborted": c.aborted,
                    "how": c.how}
                for e, c in sorted(self.nccl.items())}
