"""The per-node launcher: start worker ranks against a running coordinator and watch them.

`serve` (every node), `join` and `serve --restart-failed-ranks` share it. It

* reads the deployment's :class:`DeploymentConfig` from the coordinator's store (so a
  joiner needs only the coordinator address), or publishes it (node 0);
* records which node each rank runs on and the pid of a worker still loading (store keys
  ``elasticep/node/<rank>``, ``elasticep/launch/<rank>``);
* starts each rank as ``python -m elasticep.elastic.worker --config-json ...`` from one
  long-lived spawner thread (a worker's ``PR_SET_PDEATHSIG`` fires when the *thread* that
  spawned it exits);
* waits on every child and reports its exit to the coordinator at once (milliseconds,
  before the control socket's EOF or the heartbeat timeout), then queues the exit for
  the owner's restart policy;
* stops only the pids it started.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import re
import subprocess
import sys
import threading
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import IO

import torch.distributed as dist

from elasticep.distributed import CoordinatorClient
from elasticep.distributed.protocol import parse_address
from elasticep.elastic.config import DeploymentConfig, WorkerConfig
from elasticep.elastic.deployment import CONFIG_KEY
from elasticep.utils.procs import kill_pids, pid_alive

logger = logging.getLogger(__name__)

NODE_KEY = "elasticep/node/{rank}"
LAUNCH_KEY = "elasticep/launch/{rank}"
WORKER_MODULE = "elasticep.elastic.worker"


def open_store(address: str, timeout_s: float = 10.0) -> dist.TCPStore:
    """A client of the coordinator's rendezvous store.

    Raises:
        ConnectionError / TimeoutError: the coordinator or its store is unreachable.
    """
    client = CoordinatorClient(address, timeout_s)
    try:
        port = client.store_port
    finally:
        client.close()
    host, _ = parse_address(address)
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def publish_config(store: dist.Store, config: DeploymentConfig) -> None:
    """Node 0: make the settings available to every later rank and joiner."""
    store.set(CONFIG_KEY, config.to_json())


def fetch_config(store: dist.Store, timeout_s: float = 60.0) -> DeploymentConfig:
    """Read the settings node 0 published, waiting up to ``timeout_s`` seconds for them.

    Raises:
        TimeoutError: nothing was published in time; ValueError: unreadable config.
    """
    try:
        store.wait([CONFIG_KEY], timedelta(seconds=timeout_s))
    except RuntimeError as exc:  # torch reports store timeouts as RuntimeError subclasses
        raise TimeoutError(f"no deployment config published within {timeout_s} s") from exc
    return DeploymentConfig.from_json(store.get(CONFIG_KEY).decode())


class RankDirectory:
    """What launchers record per rank in the store: its node, and the pid of a worker
    started for it that has not exited (a joiner loads its weights before it registers
    with the coordinator, so this is how a loading joiner shows up). Node lookups are
    cached: they are read every 50 ms.

    Args:
        store: a store client (use from several threads is serialised here).
    """

    def __init__(self, store: dist.Store) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._nodes: dict[int, int] = {}

    def record_launch(self, rank: int, node: int, pid: int) -> None:
        """A launcher on ``node`` started worker ``pid`` for ``rank``."""
        with self._lock:
            self._store.set(NODE_KEY.format(rank=rank), str(node))
            self._store.set(LAUNCH_KEY.format(rank=rank), str(pid))
            self._nodes[rank] = node

    def clear_launch(self, rank: int, pid: int) -> None:
        """Worker ``pid`` of ``rank`` exited (the key is cleared only if it still holds it)."""
        with self._lock:
            self._store.compare_set(LAUNCH_KEY.format(rank=rank), str(pid), "")

    def node_of(self, rank: int) -> int:
        """Node of ``rank``; 0 if no launcher recorded it."""
        with self._lock:
            if rank not in self._nodes:
                key = NODE_KEY.format(rank=rank)
                if not self._store.check([key]):
                    return 0
                self._nodes[rank] = int(self._store.get(key).decode())
            return self._nodes[rank]

    def launched_pid(self, rank: int, local_node: int | None = None) -> int | None:
        """Pid of the last worker started for ``rank`` that has not exited, or None.

        Args:
            local_node: this machine's node; a recorded pid of this node that is not alive
                is ignored (its launcher was killed before it could clear the key).
        """
        key = LAUNCH_KEY.format(rank=rank)
        with self._lock:
            text = self._store.get(key).decode() if self._store.check([key]) else ""
        if not text:
            return None
        pid = int(text)
        if local_node is not None and self.node_of(rank) == local_node and not pid_alive(pid):
            return None
        return pid


@dataclass(frozen=True)
class RankExit:
    """A worker process ended: its rank, pid and exit code (negative: killed by signal)."""

    rank: int
    pid: int
    code: int


class RankLauncher:
    """Starts and watches this node's worker processes.

    Args:
        coordinator: ``"host:port"`` of the coordinator.
        config: the deployment's shared settings.
        node: this node's index (for the status' ``node`` field).
        directory: where to record each launch (node, pid).
        log_dir: worker ``r``'s output goes to ``log_dir/rank<r>.log`` (appended).
    """

    def __init__(self, coordinator: str, config: DeploymentConfig, node: int,
                 directory: RankDirectory, log_dir: Path) -> None:
        self.coordinator = coordinator
        self.config = config
        self.node = node
        self.directory = directory
        self.log_dir = log_dir
        self.exits: queue.Queue[RankExit] = queue.Queue()
        self._procs: dict[int, subprocess.Popen] = {}
        self._lock = threading.Lock()
        self._stopping = False
        self._client = CoordinatorClient(coordinator)
        self._spawner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="spawn")
        self._logs: list[IO] = []
        log_dir.mkdir(parents=True, exist_ok=True)

    def spawn(self, rank: int, join_mode: str | None = None) -> int:
        """Start a worker for ``rank``; returns its pid.

        Args:
            rank: global slot.
            join_mode: None (launch cohort), "recover" or "scale".
        """
        wc = WorkerConfig(self.config, rank, self.coordinator, join_mode=join_mode)
        cmd = [sys.executable, "-m", WORKER_MODULE, "--config-json", wc.to_json()]
        log = open(self.log_dir / f"rank{rank}.log", "a")  # noqa: SIM115 - closed in stop()
        self._logs.append(log)
        env = {k: v for k, v in os.environ.items() if k != "ELASTICEP_FAULT"}
        # Own session: a terminal's Ctrl-C reaches only serve/join, which then stops the
        # workers in order (a worker interrupted mid-collective would only log noise).
        proc = self._spawner.submit(subprocess.Popen, cmd, env=env, stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True).result()
        self.directory.record_launch(rank, self.node, proc.pid)
        with self._lock:
            self._procs[rank] = proc
        threading.Thread(target=self._wait_child, args=(rank, proc), daemon=True,
                         name=f"wait-rank{rank}").start()
        logger.info("node %d: rank %d started (pid %d, join_mode=%s), log %s", self.node, rank,
                    proc.pid, join_mode, log.name)
        return proc.pid

    def _wait_child(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        try:
            self.directory.clear_launch(rank, proc.pid)
        except (RuntimeError, OSError) as exc:  # the store went away with the coordinator
            logger.debug("node %d: could not clear rank %d's launch: %s", self.node, rank, exc)
        with self._lock:
            stopping = self._stopping
        if stopping:
            return
        logger.warning("node %d: rank %d (pid %d) exited with %d", self.node, rank, proc.pid,
                       code)
        try:
            with self._lock:  # one request at a time on the client's connection
                self._client.report_death(rank, pid=proc.pid)
        except (ValueError, OSError, TimeoutError) as exc:
            logger.warning("node %d: could not report rank %d's exit: %s", self.node, rank, exc)
        self.exits.put(RankExit(rank, proc.pid, code))

    def request_admission(self, ranks: list[int]) -> None:
        """Ask the active ranks to admit these slots once their joiners are ready."""
        with self._lock:
            self._client.request_admission(ranks)

    def coordinator_status(self) -> dict:
        """The coordinator's raw snapshot (``CoordinatorClient.status``)."""
        with self._lock:
            return self._client.status()

    def pids(self) -> dict[int, int]:
        """rank -> pid of the live worker this launcher started for it."""
        with self._lock:
            return {r: p.pid for r, p in self._procs.items() if p.poll() is None}

    def kill(self, rank: int) -> None:
        """Kill this launcher's worker of ``rank`` (e.g. evicted but frozen)."""
        with self._lock:
            proc = self._procs.get(rank)
        if proc is not None and proc.poll() is None:
            kill_pids([proc.pid], timeout_s=2.0)

    def log_tail(self, rank: int, lines: int = 15) -> str:
        """The last lines of a worker's log (for error messages)."""
        path = self.log_dir / f"rank{rank}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) \
            if path.exists() else ""

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL, every worker this launcher started; idempotent."""
        with self._lock:
            self._stopping = True
            pids = [p.pid for p in self._procs.values() if p.poll() is None]
        kill_pids(pids, timeout_s)
        self._spawner.shutdown(wait=True)
        self._client.close()
        for f in self._logs:
            f.close()
        self._logs = []


def kill_stale_worker(pid: int | None, rank: int) -> bool:
    """Kill an evicted-but-alive worker of ``rank`` on this machine before its slot is
    relaunched. Only a process whose command line is our worker for that rank is touched.

    Returns:
        True if a process was killed.
    """
    if pid is None or not pid_alive(pid):
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
    if WORKER_MODULE not in cmdline or not re.search(rf'"rank": {rank}[,}}]', cmdline):
        return False
    logger.warning("rank %d: killing the evicted old worker pid %d before relaunching", rank,
                   pid)
    kill_pids([pid], timeout_s=2.0)
    return True
