"""NCCL inner communicators for CUDA tensors of an elastic group (one per epoch).

An elastic group runs each collective on the inner group of the op's epoch. CPU
tensors use that epoch's ProcessGroupGloo (`epoch_groups.EpochGroups`); CUDA tensors
use the `NcclComm` this module builds next to it, over the same active slots and a
store prefix of its own, so a communicator is never shared by two epochs.

Failure handling, and why it looks like this:

* A survivor's NCCL kernel never finishes once a peer is SIGKILLed, and blocking
  ``work.wait()`` (or a timeout in it) would either hang or let the NCCL watchdog tear
  the process down. So ops are waited on by polling ``work.is_completed()`` (a CUDA
  event query, no host-device sync), checking between polls whether the coordinator
  announced a new epoch; detection therefore stays with the control connection.
* The abandoned communicator is aborted (``ncclCommAbort`` through
  ``ProcessGroupNCCL.abort``), which kills its hung kernel, on a thread of its own as
  soon as the failure decision commits; the next epoch's communicator is built and
  warmed concurrently. An aborted communicator is dropped, never reused.
* When an epoch only removes members (a failure or a planned removal) and every
  remaining member still holds the previous epoch's communicator, the new one is that
  communicator shrunk (``ncclCommShrink`` with the abort flag, through the backend's
  ``shrink``, which ``torch.distributed.shrink_group`` also calls; it takes no store
  bootstrap, and aborts the parent's hung kernels itself). The members agree on this
  through the store first, because a shrink and a fresh rendezvous never meet; where
  any member lacks the parent, or the torch/NCCL build has no shrink, or the shrink
  fails, every member builds a fresh communicator instead.

Environment (set as defaults, before any communicator exists): NVLink multicast off
(``NCCL_NVLS_ENABLE=0``; the lent GPU hosts require it), and the torch NCCL watchdog
neither tears the process down on an error nor kills it when stuck, because a dead
peer is this module's business (``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``,
``TORCH_NCCL_ENABLE_MONITORING=0``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0"),
               ("TORCH_NCCL_ENABLE_MONITORING", "0")):
    os.environ.setdefault(_k, _v)

log = logging.getLogger(__name__)

# Poll cadence of an op's completion: spin for the first SPIN_S, since a healthy NVLink
# collective finishes in tens of microseconds, then nap NAP_S per poll. YIELD: release
# the GIL between spins with sleep(0). Off: measured on H200s it adds ~75 us per op, and
# the interpreter hands the GIL to a waiting control thread every switch interval
# (5 ms) anyway, which only delays failure detection by that much.
SPIN_S = 0.02
NAP_S = 0.0005
YIELD = False
ABORT_WAIT_S = 10.0
SHRINK = os.environ.get("ELASTICEP_NCCL_SHRINK", "1") == "1"
SHRINK_TIMEOUT_S = 5.0
# In groups with on_failure="raise" (the EP data path), ops whose result is never
# fetched by another survivor (all_to_all_single) are stream-ordered instead of
# host-waited: the caller's stream waits for the NCCL work and the host returns at once,
# counting the op as completed. Why that stays sound: if a peer died before taking
# part, the op's output is garbage, but the group's next collective of any kind cannot
# complete either (the dead rank never joins it; on the GPU it also queues behind the
# dead op), so it is at or below the decision's pivot and every survivor raises there
# ("raise" never redoes a pivot, and an unfetchable op inside r..M makes everyone
# raise); the failure commit aborts the communicator, which also releases the waiting
# stream. Under on_failure="complete"
# the pivot would be redone and the garbage kept, so those groups host-wait every op.
ASYNC_UNFETCHABLE = os.environ.get("ELASTICEP_NCCL_ASYNC_UNFETCHABLE", "1") == "1"


def cuda_device_of(op) -> torch.device | None:
    """The CUDA device of an `ops` object's data, or None for a CPU op.

    Ops keep their data in ``tensor`` (all_reduce, broadcast) or ``input`` (the rest);
    barrier has neither and stays on Gloo.
    """
    for name in ("tensor", "input"):
        t = getattr(op, name, None)
        if isinstance(t, torch.Tensor):
            return t.device if t.is_cuda else None
    return None


class NcclComm:
    """The ProcessGroupNCCL of one epoch, created and warmed up on a background thread.

    Args:
        new_store: makes a fresh client of the coordinator's TCPStore (the rendezvous
            of a communicator must not queue behind another epoch's on one client).
        prefix: store prefix unique to (group, epoch).
        rank, size: this rank's index among the epoch's active slots, and their count.
        device: the CUDA device this rank's ops use.
        timeout_s: bound of the rendezvous and of the warm-up (seconds).
        parent: the previous epoch's communicator, to shrink (see module docstring),
            with ``excluded``: the parent's ranks that are not members any more.

    Attributes:
        built_s: seconds from the start of the build to the end of the warm-up, or None.
        abort_s: seconds ``abort()`` took, or None if never aborted.
        how: "shrink" or "init" once built.
    """

    def __init__(self, new_store: Callable[[], dist.Store], prefix: str, rank: int,
                 size: int, device: torch.device, timeout_s: float,
                 parent: NcclComm | None = None, excluded: list[int] | None = None) -> None:
        self.prefix, self.device, self.timeout_s = prefix, device, timeout_s
        self.pg: dist.ProcessGroupNCCL | None = None
        self.how: str | None = None
        # True while a child is being shrunk from this communicator: the reaper must
        # not close it meanwhile (a newer failure still aborts it, failing the shrink).
        self.shrinking = False
        if parent is not None:
            parent.shrinking = True
        self.error: BaseException | None = None
        self.last_work = None
        self.built_s: float | None = None
        self.abort_s: float | None = None
        self.ready = threading.Event()
        self._aborted = threading.Event()
        self._lock = threading.Lock()
        self._abort_thread: threading.Thread | None = None
        threading.Thread(target=self._build, args=(new_store, rank, size, parent, excluded),
                         daemon=True, name=f"elastic-nccl-{prefix}").start()

    def _build(self, new_store, rank: int, size: int, parent: NcclComm | None,
               excluded: list[int] | None) -> None:
        t0 = time.perf_counter()
        try:
            pg = None
            try:
                store = dist.PrefixStore(self.prefix, new_store())
                if parent is not None:
                    pg = self._shrink(store, rank, size, parent, excluded or [])
            finally:
                if parent is not None:  # its hung kernels must go whatever happened
                    parent.shrinking = False
                    parent.abort_async()
            if pg is None:
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timedelta(seconds=self.timeout_s)
                pg = dist.ProcessGroupNCCL(store, rank, size, opts)
                self.how = "init"
            with self._lock:
                if self._aborted.is_set():  # reaped before it was ever used
                    _abort_pg(pg)
                    raise RuntimeError("aborted while building")
                self.pg = pg
            # The communicator itself is created lazily by the first collective: run a
            # tiny one here so that the first real op of the epoch does not pay for it.
            with torch.cuda.device(self.device):
                x = torch.ones(1, device=self.device)
                work = pg.allreduce([x])
                deadline = time.monotonic() + self.timeout_s
                while not work.is_completed():
                    if self._aborted.is_set() or time.monotonic() > deadline:
                        raise RuntimeError("warm-up did not complete (a member is gone)")
                    time.sleep(NAP_S)
                work.wait()
            self.built_s = time.perf_counter() - t0
        except BaseException as e:  # a member died during rendezvous: a new epoch follows
            self.error = e
            log.info("nccl comm %s not built: %s", self.prefix, e)
        self.ready.set()

    def _shrink(self, store: dist.Store, rank: int, size: int, parent: NcclComm,
                excluded: list[int]):
        """The parent shrunk to this epoch's members, or None (then all members init).

        Every member first publishes whether it can shrink and reads the others', so
        all take the same road. The caller aborts the parent afterwards either way.
        """
        pg = parent.pg
        can = (SHRINK and parent.ready.is_set() and pg is not None and not parent.aborted
               and bool(getattr(pg, "supports_shrinking", False)))
        store.set(f"shrink/{rank}", b"1" if can else b"0")
        keys = [f"shrink/{r}" for r in range(size)]
        store.wait(keys, timedelta(seconds=self.timeout_s))
        if not all(store.get(k) == b"1" for k in keys):
            return None
        box: dict = {}

        def run() -> None:
            try:
                box["pg"] = pg.shrink(sorted(excluded), dist.distributed_c10d.SHRINK_ABORT, None)
            except Exception as e:
                box["error"] = e

        t = threading.Thread(target=run, daemon=True, name=f"elastic-shrink-{self.prefix}")
        t.start()
        t.join(SHRINK_TIMEOUT_S)
        if "pg" not in box:
            # A member whose shrink succeeded cannot follow this one to a fresh
            # rendezvous; its ops then time out (timeout_s), as with a dead member.
            log.warning("nccl comm %s: shrink %s; fresh communicator", self.prefix,
                        box.get("error", f"not done in {SHRINK_TIMEOUT_S}s"))
            return None
        self.how = "shrink"
        return box["pg"]

    @property
    def aborted(self) -> bool:
        return self._aborted.is_set()

    def idle(self) -> bool:
        """True if no op of this communicator can still be running on the GPU."""
        w = self.last_work
        if self.shrinking and not self.aborted:
            return False
        return self.aborted or w is None or w.is_completed()

    def abort_async(self) -> None:
        """Start aborting this communicator on a thread of its own (idempotent)."""
        with self._lock:
            if self._aborted.is_set():
                return
            self._aborted.set()
            pg = self.pg
        if pg is None:
            return

        def run() -> None:
            t0 = time.perf_counter()
            _abort_pg(pg)
            self.abort_s = time.perf_counter() - t0
            log.info("nccl comm %s aborted in %.3fs", self.prefix, self.abort_s)

        self._abort_thread = threading.Thread(target=run, daemon=True,
                                              name=f"elastic-nccl-abort-{self.prefix}")
        self._abort_thread.start()

    def wait_aborted(self, timeout_s: float = ABORT_WAIT_S) -> None:
        """Block until a started abort finished, at most timeout_s (then log and go on)."""
        t = self._abort_thread
        if t is not None:
            t.join(timeout_s)
            if t.is_alive():
                log.warning("nccl comm %s: abort still running after %.1fs", self.prefix,
                            timeout_s)

    def close(self) -> None:
        """Release the communicator (abort: the only teardown that needs no peer)."""
        self.abort_async()
        self.wait_aborted()
        self.pg = None


def _abort_pg(pg) -> None:
    try:
        pg.abort()
    except Exception as e:  # already torn down by the watchdog, or never initialised
        log.info("nccl abort: %s", e)


def wait_cuda_work(work, check: Callable[[], None], deadline: float, what: str) -> None:
    """Wait for an NCCL `work` without ever blocking inside a dead kernel.

    Polls ``work.is_completed()``; between polls `check()` may raise (a new epoch, an
    eviction) to abandon the op. When it completes, ``work.wait()`` makes the caller's
    current stream wait for the NCCL stream (no host block).

    Raises:
        TimeoutError: not completed by `deadline` (time.monotonic()).
        whatever `check` raises.
    """
    start = time.monotonic()
    while True:
        if work.is_completed():
            try:
                work.wait()
                return
            except Exception as e:  # the communicator broke: wait for the decision
                log.info("%s: nccl work failed (%s); waiting for the new epoch", what, e)
                while True:
                    check()
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{what}: nccl op failed and no new epoch "
                                           f"came: {e}") from e
                    time.sleep(0.01)
        now = time.monotonic()
        if now - start < SPIN_S:
            if YIELD:
                time.sleep(0)  # let the control thread run; a healthy op ends in microseconds
            continue
        check()
        if now > deadline:
            raise TimeoutError(f"{what}: nccl op timed out")
        time.sleep(NAP_S)
