"""The lockstep step loop of one EP rank, and its redo after a failure.

Every active rank runs the same sequence of collectives on the WORLD group, idle ranks
included (they run every MoE layer's dispatch with 0 tokens). One iteration:

1. when no batch is pending: take requests/aborts from the front-end and, if this rank
   has work, schedule (once: the ScheduledBatch is kept until committed, so a batch
   being redone, or one scheduled before an admission / removal, keeps its sequences
   and KV blocks);
2. header all_reduce (SUM, int64 ``[1 + 3*M]``, :func:`step_header` /
   :func:`parse_header`): total unfinished work; per slot how many ranks saw an
   admission / removal request for it (>0 = agreed), so every rank calls
   ``recover_ranks`` / ``deactivate_ranks`` at the same step boundary; per slot the
   tokens that rank's pending batch has (each rank writes only its own slot), so every
   rank knows the step's largest batch;
3. no work anywhere: wait for a message for a few ms (keeps idle CPU low) and loop;
4. execute (forward with dispatch/combine, sample) with a CUDA executor's
   ``step_max_tokens`` set to that agreed maximum, so every rank sizes every MoE
   layer's exchange alike without a per-layer collective (an idle rank forwards an
   empty batch under the same bound); commit all_reduce, ``engine.commit``, publish.

Tokens are published only after the commit collective, which the elastic group
returns on every survivor once any survivor completed it: a redone step never
streams a token twice. With the in-graph exchange on CUDA they go out while the next
step's forward runs on the device (:meth:`LLMEngine.execute`'s ``while_running``), so the
hand-off to the front-end is off the step's critical path; an iteration that forwards
nothing sends them first. Elsewhere the forward returns only when it is done (its
exchanges are host collectives), so they are sent at once. On ``EpochChangedError``
anywhere in 2-4 the step is abandoned, the placement is reconciled to the new
membership (:mod:`elasticep.elastic.placement_sync`), and the loop starts over at 2,
re-executing the kept batch (KV writes are idempotent).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import elasticep.distributed as ed
from elasticep.elastic import placement_sync
from elasticep.elastic.exchange_setup import sync_exchange
from elasticep.elastic.exchange_watchdog import StepWatchdog
from elasticep.elastic.fault_injection import FaultInjector
from elasticep.elastic.first_token_clock import FirstTokenClock
from elasticep.elastic.log_context import RankContext
from elasticep.elastic.serve_loop import apply_messages
from elasticep.elastic.step_profiler import StepProfiler
from elasticep.engine.llm_engine import LLMEngine
from elasticep.engine.scheduler import ScheduledBatch
from elasticep.engine.step_rate import DecodeCounters, StepRateLog
from elasticep.eplb import EPLBManager
from elasticep.eplb.weight_transfer import CheckpointLoader
from elasticep.frontend_link import WorkerChannel
from elasticep.membership.transitions import SlotState
from elasticep.moe.ep_executor import EPMoEExecutor
from elasticep.moe.ipc_exchange import IpcExchange

logger = logging.getLogger(__name__)


def _decode_counters(engine: LLMEngine) -> DecodeCounters | None:
    """The engine's decode-step counters (its model runner), or None for an engine
    without a runner (tests' stand-ins)."""
    runner = getattr(engine, "runner", None)
    return runner if hasattr(runner, "decode_eager") else None


@dataclass
class LoopStats:
    """Counters of one rank's loop (logged at exit; read by tests and bench)."""

    steps: int = 0
    redos: int = 0
    recoveries: int = 0
    reloads: int = 0
    peer_copies: int = 0
    recovery_seconds: list[float] = field(default_factory=list)
    # the epoch this rank was at, and the wall-clock time (time.time()), when it last
    # committed a step: a partition test checks that a cut-off rank commits nothing after
    # the cut, and nothing in an epoch the coordinator made without it
    last_commit_epoch: int = -1
    last_commit_time: float = 0.0


@dataclass(frozen=True)
class StepHeader:
    """The agreed (summed) step header.

    Attributes:
        work: ranks with unfinished work (0 = the whole group is idle).
        admit: slots some rank asked to admit.
        remove: slots some rank asked to remove.
        tokens: [M] scheduled tokens of each slot's rank (0 for idle or absent ranks).
    """

    work: int
    admit: list[int]
    remove: list[int]
    tokens: list[int]

    @property
    def max_tokens(self) -> int:
        """The most tokens any rank forwards this step (the exchange capacity bound)."""
        return max(self.tokens, default=0)


def step_header(local_work: int, admit: torch.Tensor, remove: torch.Tensor, rank: int,
                num_tokens: int) -> torch.Tensor:
    """This rank's contribution to the header all_reduce (SUM).

    Args:
        local_work: 1 when this rank has unfinished work or a pending batch, else 0.
        admit, remove: [M] int64 votes of this rank.
        rank: this rank's slot (< M).
        num_tokens: tokens of this rank's pending batch (0 without one).

    Returns:
        [1 + 3*M] int64: ``[local_work, admit, remove, tokens]`` with ``tokens`` zero
        except ``num_tokens`` at ``rank``.
    """
    M = admit.numel()
    if not 0 <= rank < M:
        raise ValueError(f"rank {rank} outside the {M} slots")
    tokens = [0] * M
    tokens[rank] = num_tokens
    # one tensor from one list: a step pays this on its host path, and five small torch
    # ops cost several times the list
    return torch.tensor([local_work, *admit.tolist(), *remove.tolist(), *tokens],
                        dtype=torch.int64)


def parse_header(header: torch.Tensor, M: int) -> StepHeader:
    """Read the summed header of :func:`step_header` (``[1 + 3*M]``)."""
    if header.numel() != 1 + 3 * M:
        raise ValueError(f"header of {header.numel()} entries, want {1 + 3 * M}")
    h = header.tolist()
    return StepHeader(work=h[0],
                      admit=[r for r in range(M) if h[1 + r] > 0],
                      remove=[r for r in range(M) if h[1 + M + r] > 0],
                      tokens=h[1 + 2 * M:])


@contextmanager
def agreed_max_tokens(ep: EPMoEExecutor, max_tokens: int) -> Iterator[None]:
    """Set the executor's per-step token bound (one that ``uses_step_bound``, i.e. the
    CUDA one) for the body, then restore it; other executors are untouched."""
    if not ep.uses_step_bound:
        yield
        return
    before = ep.step_max_tokens
    ep.step_max_tokens = max_tokens
    try:
        yield
    finally:
        ep.step_max_tokens = before


class LockstepLoop:
    """Runs one rank's steps in lockstep with the other active ranks.

    Args:
        engine: the rank's engine (``forward_empty_batches=True``).
        ep: the rank's EP executor (placement and expert weights).
        channel: connected worker channel to the front-end.
        group: the WORLD group (elastic, or the plain baseline group when ``elastic``
            is False).
        rank: this rank.
        elastic: the group is the fault-tolerant elastic backend.
        load_fn: checkpoint reader for orphan reloads.
        faults: fault injector (tests).
        log_ctx: updated with the epoch on every change.
        eplb: optional EPLB manager (``--enable-eplb``).
        idle_wait_s: first wait for a message when no rank has work (seconds); it
            doubles per idle iteration up to ``max_idle_wait_s``.
        log_stats_interval_s: seconds between throughput lines (:class:`StepRateLog`);
            0 turns them off.
        profiler: profiles a window of working steps
            (:class:`~elasticep.elastic.step_profiler.StepProfiler`, from
            ``$ELASTICEP_TORCH_PROFILER_DIR``); None: no profiling, and no cost.
        exchange: the rank's same-host exchange (``--moe-a2a-backend cuda_ipc``), or
            None. Its waits run inside the step's GPU work, so a watchdog releases them
            when the membership changes or the step passes ``exchange_deadline_s``; the
            commit then carries an "aborted" vote, and any vote redoes the step.
        exchange_store: the store its peers' buffers are published in (for remapping
            after membership changes).
        exchange_deadline_s: the longest a step may wait on its peers (seconds).
        defer_publish: send a step's outputs while the next forward runs (see the module
            doc); None: when ``exchange`` runs on CUDA.
    """

    def __init__(self, engine: LLMEngine, ep: EPMoEExecutor, channel: WorkerChannel,
                 group: dist.ProcessGroup | None, rank: int, elastic: bool,
                 load_fn: CheckpointLoader | None, faults: FaultInjector,
                 log_ctx: RankContext, eplb: EPLBManager | None = None,
                 idle_wait_s: float = 0.002, max_idle_wait_s: float = 0.05,
                 log_stats_interval_s: float = 10.0,
                 profiler: StepProfiler | None = None,
                 exchange: IpcExchange | None = None, exchange_store: dist.Store | None = None,
                 exchange_deadline_s: float = 30.0,
                 defer_publish: bool | None = None) -> None:
        self.engine, self.ep, self.channel, self.group = engine, ep, channel, group
        self.rank, self.elastic, self.load_fn, self.faults = rank, elastic, load_fn, faults
        self.log_ctx, self.eplb, self.idle_wait_s = log_ctx, eplb, idle_wait_s
        self.max_idle_wait_s = max_idle_wait_s
        self._idle_wait = idle_wait_s
        # the peers' expert tensors are mapped anew at the first header (see
        # _refresh_peer_weights), and after every change
        self._peer_weights_stale = True
        self.M = ep.placement.max_ep_size
        self.pending: ScheduledBatch | None = None
        # the last committed step's outputs, its epoch and the first tokens' times among
        # them, not sent yet (see the module doc)
        self._unsent: tuple[list, int, tuple] | None = None
        self.first_tokens = FirstTokenClock()
        self.defer_publish = (exchange is not None and exchange.cuda
                              if defer_publish is None else defer_publish)
        self.stats = LoopStats()
        self.rate = StepRateLog(rank, _decode_counters(engine), log_stats_interval_s)
        self.profiler = profiler
        self.exchange, self.exchange_store = exchange, exchange_store
        self.watchdog = None
        if exchange is not None:
            changed = (lambda: ed.has_pending_change(group)) if elastic else (lambda: False)
            self.watchdog = StepWatchdog(exchange, changed, exchange_deadline_s)
            if elastic:
                ed.add_change_listener(group, self.watchdog.notify)

    # ------------------------------------------------------------------ membership view
    def _epoch(self) -> int:
        return ed.get_current_epoch(self.group) if self.elastic else 0

    def _local_mask(self) -> torch.Tensor:
        if not self.elastic:
            return torch.ones(self.M, dtype=torch.bool)
        return ed.get_active_ranks(self.group).to(torch.bool)

    def _set_epoch(self) -> None:
        epoch = self._epoch()
        self.log_ctx.epoch = epoch
        self.channel.epoch = epoch

    def _requests(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[M] int64 admission / removal votes of this rank (from the coordinator's push)."""
        admit = torch.zeros(self.M, dtype=torch.int64)
        remove = torch.zeros(self.M, dtype=torch.int64)
        if self.elastic:
            req = ed.get_pending_requests(self.group)
            states = ed.get_slot_states(self.group)
            for r in req.get("admit", []):
                if states[r] == SlotState.READY:
                    admit[r] = 1
            active = self._local_mask()
            for r in req.get("remove", []):
                if bool(active[r]):
                    remove[r] = 1
        return admit, remove

    def step_request_ids(self) -> list[str]:
        """The requests a raising step may be blamed on: the pending batch's, or (the
        raise came before a batch was scheduled) every request the engine holds."""
        if self.pending is not None:
            return [it.seq.request_id for it in self.pending.items]
        return self.engine.request_ids()

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        """Serve until the process is killed, removed, or the coordinator is lost.

        Raises:
            RankRemovedError: after a planned removal of this rank (a clean exit).
            RankEvictedError, CoordinatorLostError: this rank must exit.
        """
        self._set_epoch()
        try:
            while True:
                try:
                    self._iteration()
                except ed.RankEvictedError:
                    raise
                except ed.EpochChangedError as exc:
                    self._flush_outputs()
                    self._recover(exc)
        finally:  # committed tokens still reach the front-end when this rank leaves
            try:
                self._flush_outputs()
            except Exception as err:  # noqa: BLE001 - keep the exception that ended the loop
                logger.warning("could not send the last committed step's outputs: %r", err)

    def _take_messages(self, timeout_s: float) -> None:
        """Hand the requests and aborts that arrive within ``timeout_s`` to the engine."""
        messages = self.channel.poll(timeout_s)
        if messages:
            self.first_tokens.received(messages, self.stats.steps)
            apply_messages(self.engine, self.channel, messages)

    def _flush_outputs(self) -> None:
        """Send the last committed step's outputs, if not sent yet."""
        if self._unsent is not None:
            outputs, epoch, first_tokens = self._unsent
            self._unsent = None
            self.channel.send_outputs(outputs, epoch=epoch, first_tokens=first_tokens)

    def _iteration(self) -> None:
        if self.profiler is not None:
            self.profiler.iteration_started()
        if self.pending is None:
            self._take_messages(0.0)
            if self.engine.has_unfinished():
                self.pending = self.engine.schedule()
        local_work = int(self.engine.has_unfinished() or self.pending is not None)
        admit, remove = self._requests()
        num_tokens = self.pending.num_tokens if self.pending is not None else 0
        header = step_header(local_work, admit, remove, self.rank, num_tokens)
        t_header = time.perf_counter()
        self.first_tokens.step_started()
        dist.all_reduce(header, group=self.group)
        if self._peer_weights_stale:
            self._refresh_peer_weights()
        t_execute = time.perf_counter()
        h = parse_header(header, self.M)
        if h.admit or h.remove or h.work == 0:
            self._flush_outputs()  # no forward to send them beside
        # An admission / removal returns with the pending batch kept for a later step.
        if h.admit:
            self._admit(h.admit)
            return
        if h.remove:
            self._remove(h.remove)
            return
        if h.work == 0:
            # Nobody has work: wait for a request, backing off while idle so idle ranks
            # cost little CPU; bounded, so membership changes are seen soon.
            self._idle_wait = min(self.max_idle_wait_s, self._idle_wait * 2)
            self._take_messages(self._idle_wait)
            return
        self._idle_wait = self.idle_wait_s
        if self.pending is None:  # no work here (checked above): an empty batch, 0 tokens
            self.pending = self.engine.schedule()
        self.first_tokens.scheduled(it.seq.request_id for it in self.pending.items)
        step = self.stats.steps
        self.faults.at_step(step)
        if self.faults.poison_seeds:
            self.faults.at_batch(it.seq.params.seed for it in self.pending.items)
        aborted = False
        with agreed_max_tokens(self.ep, h.max_tokens):
            if self.watchdog is None:
                tokens = self.engine.execute(self.pending, self._flush_outputs)
            else:
                self.watchdog.begin()
                try:
                    tokens = self.engine.execute(self.pending, self._flush_outputs)
                    # a sampled token was read back after the whole forward; a forward
                    # that samples nothing (an idle rank's), or whose every row failed
                    # on the host before its read, was waited for by nobody
                    if self.exchange.cuda and not any(type(t) is int for t in tokens):
                        torch.cuda.current_stream().synchronize()
                finally:
                    aborted = self.watchdog.end()
        commit = torch.tensor([step, int(aborted)], dtype=torch.int64)
        t_commit = time.perf_counter()
        dist.all_reduce(commit, op=dist.ReduceOp.MAX, group=self.group)
        if int(commit[1]):
            self._redo_aborted()
            return
        t_publish = time.perf_counter()
        self.stats.last_commit_epoch, self.stats.last_commit_time = self._epoch(), time.time()
        outputs = self.engine.commit(self.pending, tokens)
        self.pending = None
        self.stats.steps += 1
        self._unsent = (outputs, self.stats.last_commit_epoch,
                        self.first_tokens.committed(outputs, self.stats.steps))
        if not self.defer_publish:
            self._flush_outputs()
        # where a step's wall time goes: the two collectives, the forward with its
        # sampling (and, with the exchange, the wait for the GPU), then the engine's
        # commit and the outputs' hand-off (with defer_publish, their send is inside the
        # next step's forward)
        rate = self.rate
        rate.timed("header", t_execute - t_header)
        rate.timed("execute", t_commit - t_execute)
        rate.timed("commit", t_publish - t_commit)
        rate.timed("publish", time.perf_counter() - t_publish)
        line = rate.step(len(outputs), self.stats.last_commit_epoch)
        if line is not None:
            self._send_stats()
        if self.eplb is not None and self.eplb.step():
            self._flush_outputs()  # a rebalance moves weights for seconds: not after it
            result = self.eplb.rebalance(self.ep.placement, sync=True, group=self.group)
            placement_sync.commit_placement(self.ep, result.placement, self.group, self.load_fn)
        if self.profiler is not None and self.profiler.step_committed(
                num_tokens, h.max_tokens, self.stats.last_commit_epoch):
            self.profiler = None  # its window is written (or it failed): no cost from here

    def _send_stats(self) -> None:
        d = _decode_counters(self.engine)
        graphs = getattr(d, "graphs", None)
        send = getattr(self.channel, "send_stats", None)
        if send is not None:
            send(self.stats.steps, graphs.captures if graphs is not None else -1,
                 graphs.replays if graphs is not None else -1,
                 decode_replays=d.decode_replays if d is not None else 0,
                 decode_eager=d.decode_eager if d is not None else 0)

    # ------------------------------------------------------------------ changes
    def _redo_aborted(self) -> None:
        """Some rank's watchdog released its exchange waits (a deadline, with no
        membership change): every rank got here through the commit, so every send of the
        step is done; clear the flags and redo the kept batch."""
        self.stats.redos += 1
        logger.warning("step %d abandoned: a rank's exchange passed its deadline; redoing it",
                       self.stats.steps)
        self.exchange.reset(self._local_mask())


    def _recover(self, exc: ed.EpochChangedError) -> None:
        """Survivors: reconcile the placement to the new membership; retried on new failures."""
        t0 = time.perf_counter()
        self.stats.redos += int(self.pending is not None)
        while True:
            self._set_epoch()
            logger.warning("step %d abandoned (%s); reconciling placement over ranks %s",
                           self.stats.steps, exc, self._local_mask().nonzero().flatten().tolist())
            try:
                # first the hand-over again: a joiner admitted just before this change
                # may not hold the placement yet (see join_as_new_rank)
                placement_sync.share_placement(self.ep, True, self.group)
                report = placement_sync.reconcile(self.ep, self._local_mask(), self.group,
                                                  self.load_fn)
                break
            except ed.RankEvictedError:
                raise
            except ed.EpochChangedError as again:
                exc = again
        self._after_change(report, time.perf_counter() - t0)

    def _refresh_peer_weights(self) -> None:
        """Map the members' newest expert tensors and drop departed ranks' mappings (their
        memory is freed then): after the first header past a change, which every member
        entered after publishing (see :mod:`elasticep.moe.peer_weights`)."""
        self._peer_weights_stale = False
        peers = self.ep.peer_weights
        if peers is not None:
            mapped = peers.refresh(self._local_mask().nonzero().flatten().tolist())
            if mapped:
                logger.info("mapped the expert weights of ranks %s", mapped)

    def _after_change(self, report: placement_sync.ChangeReport, seconds: float) -> None:
        self._peer_weights_stale = True
        self._set_epoch()
        if self.exchange is not None:
            sync_exchange(self.exchange, self.exchange_store, self._local_mask())
        self.stats.recoveries += 1
        self.stats.reloads += report.reloads
        self.stats.peer_copies += report.peer_copies
        self.stats.recovery_seconds.append(seconds)
        if self.eplb is not None:
            self.eplb.reset_generator(self._epoch())
        logger.info("placement reconciled in %.3fs: %d checkpoint reloads, %d copied from "
                    "departed ranks' memory, %d peer copies, %d slots per rank, active %s; %s",
                    seconds, report.reloads, report.departed_copies,
                    report.peer_copies, report.slots_per_rank,
                    self.ep.placement.live_ranks(),
                    "redoing the pending step" if self.pending is not None else "no step pending")

    def _admit(self, ranks: list[int]) -> None:
        t0 = time.perf_counter()
        admitted = ed.recover_ranks(self.group, ranks)
        self._set_epoch()
        logger.info("admitted ranks %s (asked %s)", admitted, ranks)
        if not admitted:
            return
        self.faults.at_admit_start()
        placement_sync.share_placement(self.ep, True, self.group)
        self.faults.at_admit()
        report = placement_sync.reconcile(self.ep, self._local_mask(), self.group, self.load_fn)
        self._after_change(report, time.perf_counter() - t0)

    def _remove(self, ranks: list[int]) -> None:
        t0 = time.perf_counter()
        logger.info("draining ranks %s", ranks)
        report = placement_sync.drain(self.ep, ranks, self.group)
        ed.deactivate_ranks(self.group, ranks)
        if self.rank in ranks:
            raise ed.RankRemovedError(f"rank {self.rank} removed by a planned scale-down")
        self._after_change(report, time.perf_counter() - t0)


def join_as_new_rank(ep: EPMoEExecutor, group: dist.ProcessGroup | None,
                     load_fn: CheckpointLoader | None, timeout_s: float,
                     on_member: Callable[[], object] | None = None,
                     ) -> placement_sync.ChangeReport:
    """Joiner side of an admission: block in ``join_group``, then run the same first ops
    as the survivors (:func:`placement_sync.share_placement`, then
    :func:`placement_sync.reconcile`).

    A member that dies during the hand-over or the expert transfer makes the survivors
    abandon the admission and recover onto the new membership (`LockstepLoop._recover`:
    share the placement again, then reconcile); the joiner does the same instead of
    dying with them. If every rank had died (the coordinator admitted the ready joiners
    itself), nobody shares a placement and the joiners rebuild it from the checkpoint
    (:func:`placement_sync.rebuild`); if the last member dies after the hand-over,
    :func:`placement_sync.reconcile` reads every expert from the checkpoint too.

    ``on_member`` runs as soon as ``join_group`` returns: the rank is a member from then
    on (the coordinator shows it healthy), before the placement and experts arrive.

    Raises:
        TimeoutError: not admitted within ``timeout_s``.
        RankEvictedError: this rank left the group meanwhile.
    """
    ed.join_group(group, timeout_s=timeout_s)
    if on_member is not None:
        on_member()
    holds = False  # this joiner holds the survivors' placement
    while True:
        try:
            # False: every rank had died, and all members are joiners with nothing to share
            holds = placement_sync.share_placement(ep, holds, group) or holds
            settle = placement_sync.reconcile if holds else placement_sync.rebuild
            return settle(ep, ed.get_active_ranks(group).to(torch.bool), group, load_fn)
        except ed.RankEvictedError:
            raise
        except ed.EpochChangedError as exc:
            logger.warning("admission interrupted (%s); reconciling over ranks %s", exc,
                           ed.get_active_ranks(group).nonzero().flatten().tolist())
