"""Run chaos trials against one real deployment (reused across trials).

Per trial: a steady greedy streaming load runs while the schedule's faults happen, the
deployment is restored to its baseline (failed slots relaunched, scale undone; not after
the last trial, whose deployment is stopped anyway), then the load stops and the
invariants are checked. A trial that cannot restore the deployment
records a violation and the next trial gets a fresh deployment.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from elasticep.utils.procs import pid_alive
from elasticep_testkit.chaos import invariants
from elasticep_testkit.chaos.actions import ACTIONS, Target, restore
from elasticep_testkit.chaos.schedule import KINDS, Schedule, make_schedule
from elasticep_testkit.chaos.two_nodes import TwoNodes
from elasticep_testkit.harness.load import SteadyLoad, make_client, run_batch
from elasticep_testkit.harness.serve_process import ServeProcess, healthy_ranks
from elasticep_testkit.harness.status_watch import StatusWatch
from elasticep_testkit.prompts import gsm8k_prompts

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 90.0  # a request with no answer by then is a hang


@dataclass(frozen=True)
class ChaosConfig:
    """One chaos run.

    Attributes:
        trials, seed: how many trials; the schedules' random seed.
        schedule: replay this one schedule (``Schedule.describe`` form) in every trial.
        first_trial: index of the first trial (to replay trial T of a seed alone).
        ep_size: baseline healthy ranks; one more slot is reserved for scale faults.
        redundant: ``--ep-num-redundant-experts``.
        heartbeat_timeout_s: serve's ``--heartbeat-timeout``.
        device: "cpu" or "cuda".
        concurrency, max_tokens, num_prompts: the load.
        kinds, max_faults: what schedules draw from.
        settle_s: load kept after the restore, before the checks (seconds).
        nnodes: 1 (one embedded-coordinator `serve`), or 2 (two nodes with their
            membership in etcd: ``two_nodes.TwoNodes``; schedules draw the host kinds).
    """

    trials: int
    seed: int
    schedule: str | None = None
    first_trial: int = 0
    ep_size: int = 4
    redundant: int = 16
    heartbeat_timeout_s: float = 2.0
    device: str = "cpu"
    concurrency: int = 6
    max_tokens: int = 32
    num_prompts: int = 8
    kinds: tuple[str, ...] = KINDS
    max_faults: int = 2
    settle_s: float = 1.0
    nnodes: int = 1

    def serve_args(self) -> list[str]:
        # two nodes reserve no slot for a scale (no scale kind is drawn there)
        spare = 1 if self.nnodes == 1 else 0
        return ["--ep-size", str(self.ep_size), "--max-ep-size", str(self.ep_size + spare),
                "--ep-num-redundant-experts", str(self.redundant), "--heartbeat-timeout",
                str(self.heartbeat_timeout_s), "--device", self.device]

    def reproducer(self, schedule: Schedule, trial: int) -> str:
        """One line: replay this trial's schedule alone; the comment gives the command
        that replays the whole sequence (earlier trials shaped the deployment's state)."""
        common = (f"--ep-size {self.ep_size} --heartbeat-timeout {self.heartbeat_timeout_s} "
                  f"--device {self.device} --kinds {','.join(self.kinds)} "
                  f"--max-faults {self.max_faults} --nnodes {self.nnodes}")
        return (f"python -m elasticep_testkit.chaos --trials 1 {common} --schedule "
                f"'{schedule.describe()}'   # in sequence: python -m elasticep_testkit.chaos "
                f"--seed {self.seed} --first-trial {self.first_trial} "
                f"--trials {trial - self.first_trial + 1} {common}")


@dataclass
class TrialResult:
    """What one trial saw."""

    trial: int
    schedule: Schedule
    violations: list[str] = field(default_factory=list)
    clear_errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    requests: int = 0
    epochs: tuple[int, int] = (0, 0)
    seconds: float = 0.0


class Deployment:
    """The deployment, its watch and the pids of every worker it ever reported.

    ``serve`` is the `serve` whose front-end carries the load and answers the status:
    the only one, or node 1's in the 2-node deployment (``nodes``).
    """

    def __init__(self, cfg: ChaosConfig) -> None:
        self.nodes: TwoNodes | None = None
        if cfg.nnodes == 1:
            self.serve = ServeProcess.start(cfg.serve_args())
            self.watch = StatusWatch(self.serve.coordinator)
        else:
            self.nodes = TwoNodes.start(cfg.serve_args())
            self.serve = self.nodes.front
            self.watch = StatusWatch("", find_leader=self.nodes.leader)
        self.target = Target(self.serve, self.watch, cfg.ep_size, cfg.heartbeat_timeout_s,
                             nodes=self.nodes)
        self.worker_pids: set[int] = set()
        self.sample_pids()

    def sample_pids(self) -> set[int]:
        """Record the worker pids the status names now; returns them."""
        now = set(self.serve.status().pids().values())
        self.worker_pids |= now
        return now

    def serve_logs(self) -> list[Path]:
        """Every serve log holding coordinator commits (see ``invariants``)."""
        return [self.serve.log_path] if self.nodes is None else self.nodes.serve_logs()

    def log_dirs(self) -> list[Path]:
        """Every directory holding worker logs."""
        return [self.serve.log_path.parent] if self.nodes is None else self.nodes.log_dirs()

    def stop(self) -> list[int]:
        """Stop everything; returns the orphans (see ``ServeProcess.stop``)."""
        self.watch.stop()
        return self.serve.stop() if self.nodes is None else self.nodes.stop()


def run_trial(cfg: ChaosConfig, dep: Deployment, trial: int, schedule: Schedule,
              prompts: list[str], reference: dict[int, str],
              restore_after: bool = True) -> tuple[TrialResult, bool]:
    """One trial; returns its result and whether the deployment is still usable.

    Args:
        restore_after: bring the baseline back under load before the checks (False for
            the last trial: its deployment is stopped anyway).
    """
    res = TrialResult(trial, schedule)
    t0, usable = time.monotonic(), True
    e0 = dep.watch.latest().epoch
    client = make_client(dep.serve.url, REQUEST_TIMEOUT_S)
    load = SteadyLoad(client, dep.serve.model_name(), prompts, cfg.concurrency, cfg.max_tokens)
    dep.target.notes = res.notes
    try:
        time.sleep(1.0)  # every stream is mid-answer when the first fault hits
        for f in schedule.faults:
            time.sleep(f.at_s)
            logger.info("trial %d: %s", trial, f.describe())
            dep.sample_pids()
            try:
                res.violations += ACTIONS[f.kind](dep.target, f)
            except (TimeoutError, RuntimeError, LookupError) as exc:
                res.violations.append(f"{f.describe()}: {exc}")
        try:
            if restore_after:
                restore(dep.target)
        except (TimeoutError, RuntimeError) as exc:
            res.violations.append(f"could not restore the baseline: {exc}")
            usable = False
        time.sleep(cfg.settle_s)
    finally:
        logger.info("trial %d: stopping the load", trial)
        try:
            records = load.stop(REQUEST_TIMEOUT_S + 10)
        except TimeoutError as exc:
            res.violations.append(f"hang: {exc}")
            records, usable = load.records, False
    res.requests = len(records)
    # each stream's first request was sent before the first fault: all of them complete
    bad, res.clear_errors = invariants.check_requests(
        records, reference, cfg.max_tokens, min_completed=cfg.concurrency,
        errors_allowed=not schedule.leaves_survivors(cfg.ep_size))
    res.violations += bad
    # the logs hold the views even when the deployment broke
    e1 = dep.watch.latest().epoch
    res.violations += invariants.check_membership(
        invariants.worker_views(*dep.log_dirs()),
        invariants.coordinator_commits(*dep.serve_logs()), range(e0, e1 + 1),
        invariants.announced_epochs(*dep.serve_logs()))
    if usable:
        res.violations += _status_agrees(dep)
        current = dep.sample_pids()
        stale = sorted(p for p in dep.worker_pids - current if pid_alive(p))
        if stale:
            res.violations.append(f"orphan workers after the trial: pids {stale}")
    res.epochs = (e0, dep.watch.latest().epoch)
    res.seconds = time.monotonic() - t0
    return res, usable


def _status_agrees(dep: Deployment) -> list[str]:
    """/elastic_ep_status vs the coordinator, now that the membership is stable."""
    for _ in range(20):  # the two reads race a commit: retry a moment later
        status, snap = dep.serve.status(), dep.watch.latest()
        if status.healthy_ranks() == sorted(snap.active) and status.epoch == snap.epoch:
            return []
        time.sleep(0.25)
    return [f"/elastic_ep_status (epoch {status['epoch']}, healthy "
                  f"{healthy_ranks(status)}) disagrees with the coordinator ({snap})"]


def run(cfg: ChaosConfig, emit: Callable[[str], None] = print) -> list[TrialResult]:
    """All trials of ``cfg``; ``emit`` gets one line per trial (and reproducers).

    Raises:
        RuntimeError / TimeoutError: the deployment could not start, or the fault-free
            reference pass failed (nothing to compare against).
    """
    prompts = gsm8k_prompts(cfg.num_prompts)
    dep = Deployment(cfg)
    results: list[TrialResult] = []
    try:
        ref = run_batch(make_client(dep.serve.url, REQUEST_TIMEOUT_S), dep.serve.model_name(),
                        prompts, cfg.max_tokens, REQUEST_TIMEOUT_S * 2)
        if not all(r.complete(cfg.max_tokens) for r in ref):
            raise RuntimeError(f"fault-free reference pass failed: {ref}")
        reference = {r.prompt_idx: r.text for r in ref}
        for trial in range(cfg.first_trial, cfg.first_trial + cfg.trials):
            schedule = (Schedule.parse(cfg.schedule) if cfg.schedule else make_schedule(
                cfg.seed, trial, cfg.ep_size, cfg.heartbeat_timeout_s, cfg.kinds,
                cfg.max_faults, nnodes=cfg.nnodes))
            last = trial == cfg.first_trial + cfg.trials - 1
            res, usable = run_trial(cfg, dep, trial, schedule, prompts, reference,
                                    restore_after=not last)
            results.append(res)
            emit(f"trial {trial}: {schedule.describe()} | {res.requests} requests, epochs "
                 f"{res.epochs[0]}->{res.epochs[1]}, {len(res.clear_errors)} clear errors, "
                 f"{len(res.violations)} violations, {res.seconds:.1f}s"
                 + "".join(f"\n  note: {n}" for n in res.notes)
                 + "".join(f"\n  VIOLATION: {v}" for v in res.violations))
            if res.violations:
                emit(f"REPRODUCE: {cfg.reproducer(schedule, trial)}")
            if not usable:
                orphans = dep.stop()
                if orphans:
                    res.violations.append(f"orphan processes: {orphans}")
                dep = Deployment(cfg)
    finally:
        orphans = dep.stop()
    if orphans and results:
        results[-1].violations.append(f"orphan processes after serve stopped: {orphans}")
        emit(f"VIOLATION: orphan processes after serve stopped: {orphans}")
    return results
