"""Start this node's worker processes against a coordinator and watch them (behind
:class:`~elasticep.deploy.deployment.Deployment`, for serve, join and generate alike).

* each rank runs as ``python -m elasticep.elastic.worker --config-json ...`` (a fresh
  interpreter, never fork), started from one long-lived spawner thread: a worker's
  ``PR_SET_PDEATHSIG`` fires when the *thread* that spawned it exits;
* one waiter thread per worker blocks in ``Popen.wait`` and reports the exit to the
  coordinator at once (milliseconds, before the control socket's EOF or the heartbeat
  timeout), then queues it for the owner's restart policy;
* only the pids started here are ever killed.

The deployment's :class:`DeploymentConfig` is published to the coordinator
(:func:`publish_config`) so that a joiner needs only the coordinator address, and every
launch is recorded there (node, pid) for the status and for `join`'s checks.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import math
import os
import queue
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar

from elasticep.config import DeploymentConfig, JoinMode, WorkerConfig
from elasticep.elastic.exit_code import ExitCode
from elasticep.eplb.placement import initial_slots_per_rank
from elasticep.membership.client import CoordinatorClient, ReconnectingClient
from elasticep.membership.status import DeploymentStatus
from elasticep.models.config import load_model_config
from elasticep.utils.procs import OUTLIVE_MARKER_ENV, OUTLIVE_PARENT_ENV, PARENT_PID_ENV, kill_pids
from elasticep.utils.wait import wait_until

T = TypeVar("T")

logger = logging.getLogger(__name__)

WORKER_MODULE = "elasticep.elastic.worker"


def exit_log_level(code: int) -> int:
    """INFO for a worker that left after a planned removal, WARNING for any other exit."""
    return logging.INFO if code == ExitCode.REMOVED else logging.WARNING


def min_holding_ranks(config: DeploymentConfig) -> int:
    """The fewest ranks whose expert slots hold every logical expert without growing:
    ``ceil(E / slots_per_rank)`` with the slots each rank launches with (1 when the
    model's config cannot be read here: the coordinator then refuses only a retirement
    that leaves no healthy rank)."""
    try:
        mcfg = load_model_config(config.model)
        slots = initial_slots_per_rank(mcfg.num_experts, config.ep_num_redundant_experts,
                                       config.ep_size, config.slot_reserve_ranks)
    except (OSError, ValueError, KeyError) as exc:
        logger.warning("cannot size the expert slots from %s (%s); a retirement is only "
                       "refused when it leaves no healthy rank", config.model, exc)
        return 1
    return max(1, math.ceil(mcfg.num_experts / slots))


def publish_config(coordinator: str, config: DeploymentConfig) -> None:
    """Node 0: make the settings, and the initial target size, known to every later rank
    and joiner.

    Raises:
        ConnectionError / TimeoutError: the coordinator at ``"host:port"`` is unreachable.
    """
    client = CoordinatorClient(coordinator)
    try:
        client.publish_deployment(config.to_json(), config.ep_size, config.max_ep_size,
                                  min_holding_ranks(config),
                                  config.elastic_ep_scale_timeout_s)
    finally:
        client.close()


def fetch_config(coordinator: str, timeout_s: float = 60.0) -> DeploymentConfig:
    """Read the settings node 0 published, waiting up to ``timeout_s`` seconds for them.

    Raises:
        TimeoutError: nothing was published in time; ValueError: unreadable config;
        ConnectionError: the coordinator is unreachable.
    """
    client = CoordinatorClient(coordinator)
    try:
        text = wait_until(client.deployment_config, timeout_s, "the deployment config",
                          poll_s=0.1)
    finally:
        client.close()
    return DeploymentConfig.from_json(text)


@dataclass(frozen=True)
class RankExit:
    """A worker process ended: its rank, pid and exit code (negative: killed by signal)."""

    rank: int
    pid: int
    code: int


CALL_TIMEOUT_S = 5.0  # bound of a (re)connect and of each call; a live coordinator: ms


def leader_finder(config: DeploymentConfig, timeout_s: float) -> Callable[[], str] | None:
    """With an etcd ``membership_store``: a function that returns the coordinator elected
    now (waiting up to ``timeout_s`` seconds for one); None for the embedded one."""
    url = config.membership_store
    if not url.startswith("etcd://"):
        return None
    from elasticep.membership.etcd_store import find_coordinator  # etcd only if asked

    return functools.partial(find_coordinator, url, timeout_s, quiet=True)


class RankLauncher:
    """Starts worker processes for ranks and watches them, and records each launch (node,
    pid) with the coordinator; the records go when this launcher's connection closes.

    Args:
        coordinator: ``"host:port"`` of the coordinator.
        config: the deployment's shared settings.
        log_dir: worker ``r``'s stdout and stderr go to ``log_dir/rank<r>.log`` (appended);
            None: this process's.
        env: extra environment for the workers.
        new_session: start each worker in its own session, so that a terminal's Ctrl-C
            reaches only the owner, which then stops the workers in order.
        label: prefix of every log line (``"deployment"``, ``"node 1"``).
        node: this machine's node index (for the status' ``node`` field).
        outlive: a worker stops dying with this launcher once it is admitted
            (``$ELASTICEP_OUTLIVE_LAUNCHER``), so :meth:`stop` can leave members running.

    With ``config.membership_store`` on etcd the launcher follows the elected leader
    (its client looks it up on each reconnect) and records its live workers with each
    new leader, which does not know them.
    """

    def __init__(self, coordinator: str, config: DeploymentConfig, *,
                 log_dir: str | Path | None = None, env: dict[str, str] | None = None,
                 new_session: bool = False, label: str = "deployment", node: int = 0,
                 outlive: bool = False) -> None:
        self.coordinator = coordinator
        self.outlive = outlive
        self.node = node
        self.config = config
        self.log_dir = None if log_dir is None else Path(log_dir)
        self.env = env or {}
        self.new_session = new_session
        self.label = label
        self.procs: dict[int, subprocess.Popen] = {}
        self.exit_codes: dict[int, list[int]] = {}
        self.exits: queue.Queue[RankExit] = queue.Queue()
        self._lock = threading.Lock()
        self._unreported = 0  # workers whose exit is not on `exits` yet (running or reporting)
        self._stopping = False
        self._client = ReconnectingClient(coordinator, CALL_TIMEOUT_S, connect_now=True,
                                          find_leader=leader_finder(config, CALL_TIMEOUT_S),
                                          on_connect=self._record_live)
        self._spawner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ep-spawn")
        self._logs: list[IO] = []
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)

    def outlive_marker(self, rank: int) -> str:
        """The file ``rank``'s worker creates once it no longer dies with this launcher
        (:func:`elasticep.utils.procs.outlive_parent`)."""
        return os.path.join(tempfile.gettempdir(),
                            f"elasticep-outlive-{os.getpid()}-r{rank}")

    def outlived(self, rank: int) -> bool:
        """True once ``rank``'s worker cleared its parent-death signal."""
        return os.path.exists(self.outlive_marker(rank))

    # ------------------------------------------------------------------ records
    def _record(self, what: str, rank: int,
                request: Callable[[CoordinatorClient], None]) -> None:
        try:
            self.call(request)
        except (ValueError, OSError, TimeoutError) as exc:  # the coordinator went away
            logger.debug("%s: could not %s of rank %d: %s", self.label, what, rank, exc)

    def _record_live(self, client: CoordinatorClient) -> None:
        """Record every live worker on a new connection (a new leader knows none)."""
        for rank, pid in self.pids(live_only=True).items():
            client.record_launch(rank, self.node, pid)

    # ------------------------------------------------------------------ workers
    def spawn(self, rank: int, join_mode: JoinMode | None = None, fault: str | None = None
              ) -> int:
        """Start a worker for ``rank``; returns its pid.

        Args:
            rank: global slot.
            join_mode: None (launch cohort), recover or scale.
            fault: fault-injection spec for this worker; None also drops an inherited
                ``ELASTICEP_FAULT`` (a relaunch must not crash again).
        """
        # the leader this launcher reached last (a worker with an etcd store looks the
        # leader up itself if that one is gone)
        wc = WorkerConfig(self.config, rank, self._client.address, join_mode=join_mode,
                          fault=fault)
        cmd = [sys.executable, "-m", WORKER_MODULE, "--config-json", wc.to_json()]
        env = {**os.environ, **self.env, PARENT_PID_ENV: str(os.getpid()),
               OUTLIVE_PARENT_ENV: "1" if self.outlive else "0"}
        if self.outlive:
            env[OUTLIVE_MARKER_ENV] = self.outlive_marker(rank)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(env[OUTLIVE_MARKER_ENV])  # a stale one of an earlier worker
        if fault is None:
            env.pop("ELASTICEP_FAULT", None)
        log = None
        if self.log_dir is not None:
            log = open(self.log_dir / f"rank{rank}.log", "a")  # noqa: SIM115 - closed in stop()
            self._logs.append(log)
        proc = self._spawner.submit(
            subprocess.Popen, cmd, env=env, stdin=subprocess.DEVNULL, stdout=log,
            stderr=None if log is None else subprocess.STDOUT,
            start_new_session=self.new_session).result()
        self._record("record_launch", rank,
                     lambda c: c.record_launch(rank, self.node, proc.pid))
        with self._lock:
            self.procs[rank] = proc
            self._unreported += 1
        threading.Thread(target=self._wait_child, args=(rank, proc), daemon=True,
                         name=f"ep-wait-r{rank}").start()
        logger.info("%s: rank %d started (pid %d, join_mode=%s)%s", self.label, rank, proc.pid,
                    join_mode, "" if log is None else f", log {log.name}")
        return proc.pid

    def _wait_child(self, rank: int, proc: subprocess.Popen) -> None:
        try:
            self._report_exit(rank, proc, proc.wait())
        finally:
            with self._lock:
                self._unreported -= 1

    def _report_exit(self, rank: int, proc: subprocess.Popen, code: int) -> None:
        # to the coordinator first (which may take a call timeout when it is
        # unreachable), so that a relaunch never races the old worker's slot
        self._record("clear_launch", rank, lambda c: c.clear_launch(rank, proc.pid))
        with self._lock:
            self.exit_codes.setdefault(rank, []).append(code)
            stopping = self._stopping
        if stopping:
            return
        logger.log(exit_log_level(code), "%s: rank %d (pid %d) exited with %d%s", self.label,
                   rank, proc.pid, code,
                   " after a planned removal" if code == ExitCode.REMOVED else "")
        try:
            self.call(lambda c: c.report_death(rank, pid=proc.pid))
        except (ValueError, OSError, TimeoutError) as exc:
            logger.warning("%s: could not report rank %d's exit: %s", self.label, rank, exc)
        self.exits.put(RankExit(rank, proc.pid, code))

    def watching(self) -> bool:
        """True while a worker started here runs, or its exit is not on :attr:`exits`
        yet (it is being reported to the coordinator)."""
        with self._lock:
            return self._unreported > 0

    def pids(self, live_only: bool = True) -> dict[int, int]:
        """rank -> pid of the worker started last for it (only those still running if
        ``live_only``)."""
        with self._lock:
            return {r: p.pid for r, p in self.procs.items()
                    if not live_only or p.poll() is None}

    def exited(self, rank: int) -> bool:
        """No live process started here holds ``rank``."""
        proc = self.procs.get(rank)
        return proc is None or proc.poll() is not None

    def kill(self, rank: int, timeout_s: float = 2.0) -> subprocess.Popen | None:
        """Kill the live worker of ``rank`` started here (e.g. evicted but frozen): SIGTERM,
        then SIGKILL after ``timeout_s`` seconds, and reap it. Returns the killed process,
        if any."""
        with self._lock:
            proc = self.procs.get(rank)
        if proc is None or proc.poll() is not None:
            return None
        kill_pids([proc.pid], timeout_s=timeout_s)
        proc.wait(timeout_s)
        return proc

    def log_tail(self, rank: int, lines: int = 15) -> str:
        """The last lines of a worker's log (for error messages); "" without a log."""
        path = None if self.log_dir is None else self.log_dir / f"rank{rank}.log"
        if path is None or not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    # ------------------------------------------------------------------ coordinator
    def call(self, request: Callable[[CoordinatorClient], T]) -> T:
        """``request(client)`` on this launcher's coordinator client, one request at a
        time; after a partition or a lost connection the next call reconnects.

        Raises:
            ConnectionError / TimeoutError / OSError: the coordinator is unreachable.
            ValueError: it refused the request (``MembershipRequestError``).
        """
        return self._client.call(request)

    def request_admission(self, ranks: list[int]) -> None:
        """Ask the active ranks to admit these slots once their joiners are ready."""
        self.call(lambda c: c.request_admission(ranks))

    def coordinator_status(self) -> dict[str, Any]:
        """The coordinator's raw group records (``CoordinatorClient.status``)."""
        return self.call(CoordinatorClient.status)

    def deployment_status(self) -> DeploymentStatus:
        """The deployment's membership (``CoordinatorClient.deployment_status``)."""
        return self.call(CoordinatorClient.deployment_status)

    # ------------------------------------------------------------------ shutdown
    def detach(self) -> None:
        """Stop reporting exits and close the coordinator connection; idempotent."""
        with self._lock:
            self._stopping = True
        self._client.close()

    def stop(self, timeout_s: float = 5.0, keep: Collection[int] = ()) -> None:
        """:meth:`detach`, then SIGTERM and SIGKILL every worker started here but those
        whose pid is in ``keep`` (members that outlive us, see ``outlive``), and remove
        the workers' outlive markers; idempotent."""
        self.detach()
        with self._lock:
            pids = [p.pid for p in self.procs.values() if p.poll() is None
                    and p.pid not in keep]
        kill_pids(pids, timeout_s)
        self._spawner.shutdown(wait=True)
        for f in self._logs:
            f.close()
        self._logs = []
        if self.outlive:  # every worker's marker, kept or stopped: none is read again
            for rank in list(self.procs):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.outlive_marker(rank))
