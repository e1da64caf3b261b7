"""The lockstep step loop of one EP rank, and its redo after a failure.

Every active rank runs the same sequence of collectives on the WORLD group, idle ranks
included (they run every MoE layer's dispatch with 0 tokens). One iteration
(:meth:`LockstepLoop.step`: agree, then execute, then commit and publish):

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
step's forward runs on the device (:meth:`LLMEngine.execute`'s ``while_running``), off
the step's critical path; before a step that carries a prefill chunk (an eager forward,
whose launch keeps the host until nearly its end) and before an iteration that forwards
nothing, they are sent first. Elsewhere the forward returns only when it is done (its
exchanges are host collectives), so they are sent at once. On ``EpochChangedError``
anywhere in 2-4 the step is abandoned, the placement is reconciled to the new
membership (:mod:`elasticep.elastic.placement_sync`), and the loop starts over at 2,
re-executing the kept batch (KV writes are idempotent).
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

import elasticep.distributed as ed
from elasticep.elastic import placement_sync
from elasticep.elastic.exchange_setup import sync_exchange
from elasticep.elastic.exchange_watchdog import StepWatchdog, WatchedStep
from elasticep.elastic.fault_injection import FaultInjector
from elasticep.elastic.first_token_clock import FirstTokenClock
from elasticep.elastic.group_view import GroupView
from elasticep.elastic.log_context import RankContext
from elasticep.elastic.serve_loop import apply_messages
from elasticep.elastic.step_header import StepHeader, agreed_max_tokens, parse_header, step_header
from elasticep.elastic.step_profiler import StepProfiler
from elasticep.elastic.step_stats import LoopStats, StepTimers
from elasticep.engine.llm_engine import LLMEngine
from elasticep.engine.scheduler import ScheduledBatch
from elasticep.engine.step_rate import StepRateLog
from elasticep.eplb import EPLBManager
from elasticep.frontend_link import WorkerChannel
from elasticep.moe.ep_executor import EPMoEExecutor
from elasticep.moe.exchange.ipc_exchange import IpcExchange
from elasticep.moe.weight_transfer import CheckpointLoader

logger = logging.getLogger(__name__)

# how long a removed rank waits for its own copy of the removal request (seconds)
REMOVAL_READ_TIMEOUT_S = 5.0


class LockstepLoop:
    """Runs one rank's steps in lockstep with the other active ranks.

    Args:
        engine: the rank's engine (``forward_empty_batches=True``).
        ep: the rank's EP executor (placement and expert weights).
        channel: connected worker channel to the front-end.
        group: the WORLD group (elastic, or the plain baseline group when
            ``fault_tolerant`` is False).
        rank: this rank.
        fault_tolerant: the group is the fault-tolerant elastic backend.
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
            after membership changes); a ``LeaderStore`` moves to a new leader's store
            at the next step.
        exchange_deadline_s: the longest a step may wait on its peers (seconds).
        defer_publish: send a step's outputs while the next forward runs (see the module
            doc); None: when ``exchange`` runs on CUDA.
    """

    def __init__(self, engine: LLMEngine, ep: EPMoEExecutor, channel: WorkerChannel,
                 group: dist.ProcessGroup | None, rank: int, fault_tolerant: bool,
                 load_fn: CheckpointLoader | None, faults: FaultInjector,
                 log_ctx: RankContext, eplb: EPLBManager | None = None,
                 idle_wait_s: float = 0.002, max_idle_wait_s: float = 0.05,
                 log_stats_interval_s: float = 10.0,
                 profiler: StepProfiler | None = None,
                 exchange: IpcExchange | None = None,
                 exchange_store: dist.Store | ed.LeaderStore | None = None,
                 exchange_deadline_s: float = 30.0,
                 defer_publish: bool | None = None) -> None:
        self.engine, self.ep, self.channel, self.group = engine, ep, channel, group
        self.rank, self.fault_tolerant, self.load_fn = rank, fault_tolerant, load_fn
        self.faults = faults
        self.log_ctx, self.eplb, self.idle_wait_s = log_ctx, eplb, idle_wait_s
        self.max_idle_wait_s = max_idle_wait_s
        self._idle_wait = idle_wait_s
        # the peers' expert tensors are mapped anew at the first header (see
        # _refresh_peer_weights), and after every change
        self._peer_weights_stale = True
        self.M = ep.placement.max_ep_size
        self.view = GroupView(group, fault_tolerant, self.M)
        self.pending: ScheduledBatch | None = None
        # the last committed step's outputs, its epoch and the first tokens' times among
        # them, not sent yet (see the module doc)
        self._unsent: tuple[list, int, tuple] | None = None
        self.first_tokens = FirstTokenClock()
        self.defer_publish = (exchange is not None and exchange.cuda
                              if defer_publish is None else defer_publish)
        self.stats = LoopStats()
        self.rate = StepRateLog(rank, engine.runner, log_stats_interval_s)
        self.profiler = profiler
        self.exchange, self.exchange_store = exchange, exchange_store
        self.watchdog = None
        if exchange is not None:
            changed = ((lambda: ed.has_pending_change(group)) if fault_tolerant
                       else (lambda: False))
            self.watchdog = StepWatchdog(exchange, changed, exchange_deadline_s)
            if fault_tolerant:
                ed.add_change_listener(group, self.watchdog.notify)

    # ------------------------------------------------------------------ membership view
    def _set_epoch(self) -> None:
        epoch = self.view.epoch()
        self.log_ctx.epoch = epoch
        self.channel.epoch = epoch

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
                    self.step()
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

    def step(self) -> None:
        """One iteration of the loop: agree on the step's header with every active rank,
        then (when the group has work and no membership change is due) execute the
        batch and commit and publish it. Each phase's wall time goes to the rate log.

        Raises:
            EpochChangedError: the membership changed during the step (:meth:`run`
                recovers and redoes the kept batch).
            RankRemovedError, RankEvictedError, CoordinatorLostError: as :meth:`run`.
        """
        if self.profiler is not None:
            self.profiler.iteration_started()
        timers = StepTimers()
        agreed = self._agree(timers)
        if agreed is None:
            return
        h, num_tokens = agreed
        timers.enter("execute")
        tokens, aborted = self._execute(h)
        self._commit_and_publish(h, num_tokens, tokens, aborted, timers)

    def _agree(self, timers: StepTimers) -> tuple[StepHeader, int] | None:
        """Schedule this rank's batch (once: it is kept until committed) and agree on the
        header; act on an agreed admission, removal or idleness here. Returns the header
        and this rank's batch tokens, or None when the iteration ends with no forward."""
        if self.pending is None:
            self._take_messages(0.0)
            if self.engine.has_unfinished():
                self.pending = self.engine.schedule()
        local_work = int(self.engine.has_unfinished() or self.pending is not None)
        admit, remove = self.view.votes()
        if isinstance(self.exchange_store, ed.LeaderStore):  # marked before the new
            self.exchange_store.try_catch_up()  # leader's requests: before any admission
        num_tokens = self.pending.num_tokens if self.pending is not None else 0
        header = step_header(local_work, admit, remove, self.rank, num_tokens)
        timers.enter("header")
        self.first_tokens.step_started()
        dist.all_reduce(header, group=self.group)
        if self._peer_weights_stale:
            self._refresh_peer_weights()
        h = parse_header(header, self.M)
        if h.admit or h.remove or h.work == 0:
            self._flush_outputs()  # no forward to send them beside
        # An admission / removal returns with the pending batch kept for a later step.
        if h.admit:
            self._admit(h.admit)
            return None
        if h.remove:
            self._remove(h.remove)
            return None
        if h.work == 0:
            # Nobody has work: wait for a request, backing off while idle so idle ranks
            # cost little CPU; bounded, so membership changes are seen soon.
            self._idle_wait = min(self.max_idle_wait_s, self._idle_wait * 2)
            self._take_messages(self._idle_wait)
            return None
        self._idle_wait = self.idle_wait_s
        return h, num_tokens

    def _execute(self, h: StepHeader) -> tuple[list, bool]:
        """Forward the kept batch (an empty one on an idle rank) under the agreed token
        bound, watched when the exchange waits inside the GPU; returns the sampled tokens
        and whether a watchdog released the step's waits (then it must be redone)."""
        if self.pending is None:  # no work here (checked above): an empty batch, 0 tokens
            self.pending = self.engine.schedule()
        self.first_tokens.scheduled(it.seq.request_id for it in self.pending.items)
        if not self.pending.one_token_each:
            # an eager forward (prefill) returns to the host only near its end: the last
            # step's tokens, often new requests' first ones, would wait that long (an
            # idle rank's empty batch sends its few leftovers here too, at no cost)
            self._flush_outputs()
        self.faults.at_step(self.stats.steps)
        if self.faults.poison_seeds:
            self.faults.at_batch(it.seq.params.seed for it in self.pending.items)
        watch = self.watchdog.watch() if self.watchdog is not None else nullcontext(
            WatchedStep())
        with agreed_max_tokens(self.ep, h.max_tokens), watch as watched:
            tokens = self.engine.execute(self.pending, self._flush_outputs)
            # a sampled token was read back after the whole forward; a forward that
            # samples nothing (an idle rank's), or whose every row failed on the host
            # before its read, was waited for by nobody
            if (self.watchdog is not None and self.exchange.cuda
                    and not any(type(t) is int for t in tokens)):
                torch.cuda.current_stream().synchronize()
        return tokens, watched.aborted

    def _commit_and_publish(self, h: StepHeader, num_tokens: int, tokens: list,
                            aborted: bool, timers: StepTimers) -> None:
        """Commit the step with every rank (any abort vote redoes it instead), then
        commit it in the engine and hand its outputs to the front-end (now, or beside
        the next forward); then the rate log, EPLB and the profiler see it."""
        commit = torch.tensor([self.stats.steps, int(aborted)], dtype=torch.int64)
        timers.enter("commit")
        dist.all_reduce(commit, op=dist.ReduceOp.MAX, group=self.group)
        if int(commit[1]):
            self._redo_aborted()
            return
        timers.enter("publish")
        self.stats.last_commit_epoch, self.stats.last_commit_time = self.view.epoch(), time.time()
        outputs = self.engine.commit(self.pending, tokens)
        self.pending = None
        self.stats.steps += 1
        self._unsent = (outputs, self.stats.last_commit_epoch,
                        self.first_tokens.committed(outputs, self.stats.steps))
        if not self.defer_publish:
            self._flush_outputs()
        for phase, seconds in timers.durations().items():
            self.rate.timed(phase, seconds)
        if self.rate.step(len(outputs), self.stats.last_commit_epoch) is not None:
            self._send_stats()
        if self.eplb is not None and self.eplb.step():
            self._flush_outputs()  # a rebalance moves weights for seconds: not after it
            result = self.eplb.rebalance(self.ep.placement, sync=True, group=self.group)
            placement_sync.commit_placement(self.ep, result.placement, self.group, self.load_fn)
        if self.profiler is not None and self.profiler.step_committed(
                num_tokens, h.max_tokens, self.stats.last_commit_epoch):
            self.profiler = None  # its window is written (or it failed): no cost from here

    def _send_stats(self) -> None:
        d = self.engine.runner
        graphs = d.graphs
        self.channel.send_stats(self.stats.steps, graphs.captures if graphs is not None else -1,
                                graphs.replays if graphs is not None else -1,
                                decode_replays=d.decode_replays, decode_eager=d.decode_eager,
                                prefill_replays=d.prefill_replays,
                                experts_held=self.ep.placement.experts_held(self.rank))

    # ------------------------------------------------------------------ changes
    def _redo_aborted(self) -> None:
        """Some rank's watchdog released its exchange waits (a deadline, with no
        membership change): every rank got here through the commit, so every send of the
        step is done; clear the flags and redo the kept batch."""
        self.stats.redos += 1
        logger.warning("step %d abandoned: a rank's exchange passed its deadline; redoing it",
                       self.stats.steps)
        self.exchange.reset(self.view.active_mask())

    def _recover(self, exc: ed.EpochChangedError) -> None:
        """Survivors: reconcile the placement to the new membership; retried on new failures."""
        t0 = time.perf_counter()
        self.stats.redos += int(self.pending is not None)
        while True:
            self._set_epoch()
            logger.warning("step %d abandoned (%s); reconciling placement over ranks %s",
                           self.stats.steps, exc, self.view.active_mask().nonzero().flatten().tolist())
            try:
                # first the hand-over again: a joiner admitted just before this change
                # may not hold the placement yet (see join_as_new_rank)
                placement_sync.share_placement(self.ep, True, self.group)
                report = placement_sync.reconcile(self.ep, self.view.active_mask(), self.group,
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
            mapped = peers.refresh(self.view.active_mask().nonzero().flatten().tolist())
            if mapped:
                logger.info("mapped the expert weights of ranks %s", mapped)

    def _after_change(self, report: placement_sync.ChangeReport, seconds: float) -> None:
        self._peer_weights_stale = True
        self._set_epoch()
        if self.exchange is not None:
            sync_exchange(self.exchange, self.exchange_store, self.view.active_mask())
        self.stats.recoveries += 1
        self.stats.reloads += report.reloads
        self.stats.peer_copies += report.peer_copies
        self.stats.recovery_seconds.append(seconds)
        if self.eplb is not None:
            self.eplb.reset_generator(self.view.epoch())
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
        report = placement_sync.reconcile(self.ep, self.view.active_mask(), self.group, self.load_fn)
        self._after_change(report, time.perf_counter() - t0)

    def _remove(self, ranks: list[int]) -> None:
        t0 = time.perf_counter()
        logger.info("draining ranks %s", ranks)
        # read with the removal request: the commit that applies it may clear it; and
        # only once this rank's own copy has the request (the header came from another
        # member's copy: read early, a kept rank exited)
        if self.rank in ranks and not ed.wait_removal_known(self.group, self.rank,
                                                             REMOVAL_READ_TIMEOUT_S):
            logger.warning("rank %d: the removal request did not reach this rank within "
                           "%.0f s; exiting, not staying up", self.rank,
                           REMOVAL_READ_TIMEOUT_S)
        keep = self.rank in ed.get_pending_requests(self.group).get("keep", [])
        report = placement_sync.drain(self.ep, ranks, self.group)
        ed.deactivate_ranks(self.group, ranks)
        if self.rank in ranks:
            raise ed.RankRemovedError(f"rank {self.rank} removed by a planned scale-down",
                                      keep_process=keep)
        self._after_change(report, time.perf_counter() - t0)
