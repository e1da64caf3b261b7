"""The per-node launcher: start worker ranks against a running coordinator and watch them.

`serve` (every node), `join` and `serve --restart-failed-ranks` share it. It reads the
deployment's :class:`DeploymentConfig` from the coordinator (so a joiner needs only the
coordinator address), or publishes it (node 0); starts, waits on and reports workers
with the elastic layer's :class:`~elasticep.elastic.launcher.WorkerLauncher` (also
behind ``LocalDeployment``), each in its own session, recording each launch (node, pid)
with the coordinator; and stops only the pids it started.
"""

from __future__ import annotations

import logging
from pathlib import Path

from elasticep.elastic.config import DeploymentConfig
from elasticep.elastic.launcher import RankExit, WorkerLauncher, fetch_config, publish_config
from elasticep.utils.procs import kill_pids, pid_alive

__all__ = ["RankExit", "RankLauncher", "fetch_config", "kill_stale_worker", "publish_config"]

logger = logging.getLogger(__name__)


class RankLauncher(WorkerLauncher):
    """Starts and watches this node's worker processes (each in its own session, so a
    terminal's Ctrl-C reaches only serve/join, which then stops the workers in order).

    Args:
        coordinator: ``"host:port"`` of the coordinator.
        config: the deployment's shared settings.
        node: this node's index (for the status' ``node`` field).
        log_dir: worker ``r``'s output goes to ``log_dir/rank<r>.log`` (appended).
    """

    def __init__(self, coordinator: str, config: DeploymentConfig, node: int,
                 log_dir: Path) -> None:
        super().__init__(coordinator, config, log_dir=log_dir, new_session=True,
                         label=f"node {node}", node=node)


def kill_stale_worker(pid: int | None, rank: int) -> bool:
    """Kill an evicted-but-alive worker of ``rank`` on this machine before its slot is
    relaunched: ``pid`` is the one the coordinator recorded for the slot, and the caller
    has checked that the slot's last launch was on this node.

    Returns:
        True if a process was killed.
    """
    if pid is None or not pid_alive(pid):
        return False
    logger.warning("rank %d: killing the evicted old worker pid %d before relaunching", rank,
                   pid)
    kill_pids([pid], timeout_s=2.0)
    return True
