"""The per-node launcher: start worker ranks against a running coordinator and watch them.

`serve` (every node), `join` and `serve --restart-failed-ranks` share it. It

* reads the deployment's :class:`DeploymentConfig` from the coordinator's store (so a
  joiner needs only the coordinator address), or publishes it (node 0);
* records which node each rank runs on and the pid of a worker still loading (store keys
  ``elasticep/node/<rank>``, ``elasticep/launch/<rank>``);
* starts, waits on and reports workers with the elastic layer's
  :class:`~elasticep.elastic.launcher.WorkerLauncher` (also behind ``LocalDeployment``),
  each in its own session, and queues every exit for the owner's restart policy;
* stops only the pids it started.
"""

from __future__ import annotations

import logging
import re
import threading
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from elasticep.distributed import CoordinatorClient
from elasticep.distributed.protocol import parse_address
from elasticep.elastic.config import DeploymentConfig
from elasticep.elastic.launcher import (
    WORKER_MODULE,
    RankExit,
    WorkerLauncher,
    fetch_config,
    publish_config,
)
from elasticep.utils.procs import kill_pids, pid_alive

__all__ = ["RankDirectory", "RankExit", "RankLauncher", "fetch_config", "kill_stale_worker",
           "open_store", "publish_config"]

logger = logging.getLogger(__name__)

NODE_KEY = "elasticep/node/{rank}"
LAUNCH_KEY = "elasticep/launch/{rank}"


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


class RankLauncher(WorkerLauncher):
    """Starts and watches this node's worker processes (each in its own session, so a
    terminal's Ctrl-C reaches only serve/join, which then stops the workers in order) and
    records each launch in the store.

    Args:
        coordinator: ``"host:port"`` of the coordinator.
        config: the deployment's shared settings.
        node: this node's index (for the status' ``node`` field).
        directory: where to record each launch (node, pid).
        log_dir: worker ``r``'s output goes to ``log_dir/rank<r>.log`` (appended).
    """

    def __init__(self, coordinator: str, config: DeploymentConfig, node: int,
                 directory: RankDirectory, log_dir: Path) -> None:
        super().__init__(coordinator, config, log_dir=log_dir, new_session=True,
                         label=f"node {node}")
        self.node = node
        self.directory = directory

    def on_launch(self, rank: int, pid: int) -> None:
        """Record the worker's node and pid (shown as joining until it registers)."""
        self.directory.record_launch(rank, self.node, pid)

    def on_exit(self, rank: int, pid: int) -> None:
        """Clear the worker's launch record."""
        try:
            self.directory.clear_launch(rank, pid)
        except (RuntimeError, OSError) as exc:  # the store went away with the coordinator
            logger.debug("node %d: could not clear rank %d's launch: %s", self.node, rank, exc)


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
