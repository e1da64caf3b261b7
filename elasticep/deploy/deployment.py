"""One EP deployment's ranks on this machine: the one way `serve`, `join` and
`generate --ep-size` start, relaunch, scale and stop ranks.

    dep = Deployment.start(DeploymentConfig(model=..., ep_size=4, max_ep_size=6,
                                            frontend_request_addr=..., ...))
    dep.wait_healthy(timeout_s=60)   # coordinator + ranks 0..3 on this machine
    dep.relaunch(2)                  # a dead slot comes back (join mode "recover")
    dep.scale(6, start_joiners=True) # 4 -> 6: the new slots' joiners start here
    dep.scale(4)                     # slots [4, 6) drain and leave
    dep.status()                     # the /elastic_ep_status view
    dep.stop()

    dep = Deployment.attach("10.0.0.1:29400", node=1)   # serve --node-rank 1, join

Node 0 (:meth:`Deployment.start`) runs the coordinator as a child process
(:class:`~elasticep.membership.process.CoordinatorProcess`): outside every worker, so
any rank (rank 0 included) may die, and outside this process, so that no stall of the
front-end beside it can starve heartbeats. Every node's ranks are
fresh interpreters started and watched by :class:`~elasticep.deploy.launcher.RankLauncher`,
which reports each death to the coordinator at once. The coordinator owns the membership
(target size, scale phase, slot states, launch records); this class only acts on it.
The ``elastic`` / ``none`` difference is :meth:`membership`'s choice, made once.
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from elasticep.config import Backend, DeploymentConfig, JoinMode
from elasticep.deploy.coordinator_replica import CoordinatorReplica
from elasticep.deploy.launcher import (
    RankExit,
    RankLauncher,
    fetch_config,
    leader_finder,
    publish_config,
)
from elasticep.deploy.membership_backends import CoordinatorMembership, LaunchedRanks
from elasticep.deploy.startup_error import RankStartupError, loading_failure
from elasticep.frontend_link import WorkerHello
from elasticep.membership.process import CoordinatorProcess
from elasticep.membership.status import DeploymentStatus
from elasticep.membership.transitions import ACTIVE_STATES, SlotState
from elasticep.utils.procs import kill_pids, pid_alive
from elasticep.utils.wait import wait_until

__all__ = ["Deployment", "RankExit", "RankStartupError"]

logger = logging.getLogger(__name__)


class Deployment:
    """The ranks this machine runs for one deployment, and the coordinator if node 0.

    Use :meth:`start` (node 0) or :meth:`attach` (other nodes, `join`).

    Args:
        address: the coordinator's ``"host:port"``.
        config: the deployment's shared settings.
        node: this machine's node index.
        coordinator: the coordinator process this one started (node 0), stopped with it.
        replica: this node's standby coordinator replica (other nodes, with etcd),
            stopped with it.
        log_dir: worker ``r``'s output goes to ``log_dir/rank<r>.log``; None: stderr.
        env: extra environment for the workers.
        new_session: start each worker in its own session, so a terminal's Ctrl-C reaches
            only the command, which then stops the workers in order.
        outlive: a worker stops dying with this process once it is admitted, so that
            :meth:`hand_over` can leave the members running (`join`).
    """

    def __init__(self, address: str, config: DeploymentConfig, *, node: int = 0,
                 coordinator: CoordinatorProcess | CoordinatorReplica | None = None,
                 replica: CoordinatorReplica | None = None,
                 log_dir: str | Path | None = None, env: dict[str, str] | None = None,
                 new_session: bool = False, outlive: bool = False) -> None:
        self.address = address
        self.config = config
        self.node = node
        self.coordinator = coordinator
        self.replica = replica
        self.launcher = RankLauncher(address, config, log_dir=log_dir, env=env,
                                     new_session=new_session, node=node,
                                     label=f"node {node}", outlive=outlive)
        self._membership: CoordinatorMembership | LaunchedRanks | None = None

    # ------------------------------------------------------------------ assembly
    @classmethod
    def start(cls, config: DeploymentConfig, *, host: str = "127.0.0.1", port: int = 0,
              hb_interval_s: float = 0.2, ranks: list[int] | None = None,
              fault: str | None = None,
              on_coordinator_exit: Callable[[int], None] | None = None,
              membership_store: str | None = None, deployment_id: str | None = None,
              **kwargs: Any) -> Deployment:
        """Node 0: start the coordinator, publish the settings and launch ``ranks``
        (default ``0..ep_size-1``). Returns at once; see :meth:`wait_healthy`.

        Args:
            config: the settings; the front-end addresses must be set. ``store_addr`` is
                filled in here (with backend ``none`` the capacity is ``ep_size``: the
                config refuses another ``max_ep_size``).
            host, port: the coordinator's control endpoint (0: a free port).
            hb_interval_s: heartbeat period (seconds).
            ranks: the ranks this node launches.
            fault: fault-injection spec of the launch cohort (never of a relaunch).
            on_coordinator_exit: called with the coordinator process's exit status if it
                dies before :meth:`stop` (from a watcher thread): the deployment cannot
                go on without it, so the owner should stop. Not with etcd.
            membership_store, deployment_id: ``--membership-store`` (None: embedded)
                and the id this deployment claims its prefix with. With etcd the
                coordinator is this node's replica (``coordinator_replica.py``): when it
                dies a standby replaces it, and the ranks resume with whichever leads.
            **kwargs: ``log_dir``, ``env``, ``new_session`` (see the class).

        Raises:
            OSError: the coordinator cannot bind ``host:port``, or its process failed.
            TimeoutError: its process did not come up.
        """
        coordinator: CoordinatorProcess | CoordinatorReplica
        if membership_store and membership_store.startswith("etcd://"):
            # a dead replica is replaced by a standby: the ranks follow the leader
            coordinator = CoordinatorReplica.leader(
                host, port, membership_store, deployment_id or "elasticep",
                hb_interval_s=hb_interval_s, hb_timeout_s=config.heartbeat_timeout_s)
        else:
            coordinator = CoordinatorProcess.start(host, port, hb_interval_s=hb_interval_s,
                                                   hb_timeout_s=config.heartbeat_timeout_s,
                                                   on_exit=on_coordinator_exit)
        try:
            config = replace(config, store_addr=f"{host}:{coordinator.store_port}")
            publish_config(coordinator.address, config)
            dep = cls(coordinator.address, config, coordinator=coordinator, **kwargs)
        except BaseException:
            coordinator.close()
            raise
        logger.info("deployment: coordinator %s, %d ranks (capacity %d, backend %s)",
                    coordinator.address, config.ep_size, config.max_ep_size,
                    config.elastic_ep_backend)
        dep.launch(list(range(config.ep_size)) if ranks is None else ranks, fault=fault)
        return dep

    @classmethod
    def attach(cls, address: str, *, node: int = 0, config_timeout_s: float = 60.0,
               **kwargs: Any) -> Deployment:
        """Another node, or `join`: read the settings node 0 published; launch nothing yet.

        Raises:
            ConnectionError / TimeoutError: the coordinator is unreachable or published
                nothing within ``config_timeout_s`` seconds.
        """
        return cls(address, fetch_config(address, config_timeout_s), node=node, **kwargs)

    # ------------------------------------------------------------------ ranks
    def launch(self, ranks: list[int], join_mode: JoinMode | None = None,
               fault: str | None = None) -> list[int]:
        """Start a worker for each of ``ranks``; returns their pids.

        Args:
            join_mode: None (launch cohort), recover or scale.
            fault: fault-injection spec (None also drops an inherited one).
        """
        return [self.launcher.spawn(r, join_mode, fault) for r in ranks]

    def relaunch(self, *ranks: int) -> list[int]:
        """The one relaunch path (`join recover`, ``--restart-failed-ranks``, tests):
        kill a stale worker of each slot (:meth:`kill_stale`), start a fresh one in join
        mode "recover", and ask the ranks to admit them once they are ready.

        Returns:
            The new pids.

        Raises:
            ValueError: a slot is outside the capacity.
        """
        for r in ranks:
            if not 0 <= r < self.config.max_ep_size:
                raise ValueError(f"rank {r} outside [0, {self.config.max_ep_size})")
        for r in ranks:
            self.kill_stale(r)
        pids = self.launch(list(ranks), JoinMode.RECOVER)
        self.launcher.request_admission(list(ranks))
        return pids

    def kill_stale(self, rank: int, status: DeploymentStatus | None = None) -> bool:
        """Kill a worker of ``rank`` that was evicted but still runs (frozen) before its
        slot is relaunched: this launcher's own child, else the pid the coordinator
        recorded for the slot if its last launch was on this node.

        Returns:
            True if a process was killed.
        """
        if self.launcher.kill(rank, timeout_s=5.0) is not None:
            return True
        try:
            entry = (status or self.deployment_status()).rank(rank)
        except (KeyError, ConnectionError, TimeoutError, OSError, ValueError):
            return False
        if entry.node != self.node or entry.pid is None or not pid_alive(entry.pid):
            return False
        logger.warning("rank %d: killing the evicted old worker pid %d before relaunching",
                       rank, entry.pid)
        kill_pids([entry.pid], timeout_s=2.0)
        return True

    def kill(self, rank: int) -> None:
        """Kill this launcher's live worker of ``rank`` (e.g. evicted but frozen)."""
        self.launcher.kill(rank)

    def scale(self, new_ep_size: int, start_joiners: bool = False) -> dict[str, Any]:
        """Make ``new_ep_size`` the target, as ``POST /scale_elastic_ep`` does: growing
        admits the joiners of the lowest free slots (``[ep_size, new)`` unless ranks were
        retired), shrinking drains and removes the highest active slots of the target.

        Args:
            start_joiners: also start the new slots' joiners here (join mode "scale");
                serve leaves that to `elasticep join`.

        Returns:
            {"old_ep_size", "slots", "scale_phase", "operation_id"}.

        Raises:
            ScaleNotSupportedError: backend ``none``; ScaleInProgressError, ValueError:
                refused by the coordinator.
        """
        result = self.membership().scale(new_ep_size)
        if start_joiners and new_ep_size > result["old_ep_size"]:
            self.launch([r for r in result["slots"] if self.launcher.exited(r)], JoinMode.SCALE)
        return result

    # ------------------------------------------------------------------ membership
    @property
    def fault_tolerant(self) -> bool:
        """Whether a rank's exit is survivable (backend ``elastic``); with ``none`` the
        first exit stops the deployment."""
        return self.config.elastic_ep_backend == Backend.ELASTIC

    def membership(self, connected: Callable[[], Mapping[int, WorkerHello]] | None = None
                   ) -> CoordinatorMembership | LaunchedRanks:
        """The front-end's ``MembershipSource`` for this deployment, chosen once: the
        coordinator's view (``elastic``), or the launcher's (``none``; ``connected``, the
        front-end's hellos, makes a rank healthy only once it said hello)."""
        if self._membership is None:
            if self.fault_tolerant:
                self._membership = CoordinatorMembership(
                    self.address, find_leader=leader_finder(self.config, 5.0))
            else:
                self._membership = LaunchedRanks(self.launcher, self.config.ep_size,
                                                 connected)
        return self._membership

    def status(self) -> DeploymentStatus:
        """The ``/elastic_ep_status`` view (see :meth:`membership`)."""
        return self.membership().status()

    def deployment_status(self) -> DeploymentStatus:
        """Alias of :meth:`status` (the name the supervisor and `join` use)."""
        return self.status()

    def active_ranks(self) -> list[int]:
        """Ranks active in WORLD's committed epoch (elastic backend)."""
        world = self.launcher.coordinator_status()["groups"].get("world")
        return [] if world is None else sorted(world["ranks"][s] for s in world["active"])

    def wait_healthy(self, ranks: list[int] | None = None, timeout_s: float = 120.0) -> None:
        """Block until ``ranks`` (default: the launch cohort) are healthy.

        Raises:
            TimeoutError: not within ``timeout_s``.
            RankStartupError: one of them exited (the lowest such rank, in one line
                with its log's last exception; see :func:`loading_failure`).
        """
        want = set(range(self.config.ep_size) if ranks is None else ranks)

        def healthy() -> bool:
            dead = sorted(r for r in want if r in self.procs
                          and self.procs[r].poll() is not None)
            if dead:
                rank, code = dead[0], self.procs[dead[0]].returncode
                if self.log_dir is None:  # its output went to this process's stderr
                    raise RankStartupError(rank, code, f"rank {rank} exited with {code} "
                                           "while loading (its output is above)")
                raise RankStartupError(rank, code, loading_failure(
                    rank, code, self.log_tail(rank), self.log_dir))
            states = self.status().states()
            return all(states.get(r) == SlotState.HEALTHY for r in want)

        wait_until(healthy, timeout_s, f"ranks {sorted(want)} healthy")

    # ------------------------------------------------------------------ processes
    @property
    def procs(self) -> dict[int, subprocess.Popen]:
        """rank -> the latest process started here for it."""
        return self.launcher.procs

    @property
    def exit_codes(self) -> dict[int, list[int]]:
        """rank -> exit codes of its processes so far, oldest first."""
        return self.launcher.exit_codes

    @property
    def exits(self):
        """Queue of :class:`RankExit`, one per worker exit (not while stopping)."""
        return self.launcher.exits

    def watching(self) -> bool:
        """True while a worker started here runs or its exit is still being reported
        (:meth:`RankLauncher.watching`)."""
        return self.launcher.watching()

    def pids(self, live_only: bool = False) -> dict[int, int]:
        """rank -> pid of the latest process started here for it."""
        return self.launcher.pids(live_only=live_only)

    def log_tail(self, rank: int, lines: int = 15) -> str:
        """The end of a worker's log ("" without a log)."""
        return self.launcher.log_tail(rank, lines)

    @property
    def log_dir(self) -> Path | None:
        """Where the worker logs go."""
        return self.launcher.log_dir

    def hand_over(self, timeout_s: float = 5.0) -> dict[int, int]:
        """Stop like :meth:`stop`, but leave the workers started here that are members
        (active in the coordinator's view, with our pid) running in the deployment: the
        coordinator tracks them by pid, and a `serve --restart-failed-ranks` of this node
        relaunches them if they fail. Needs ``outlive``; the others (still loading, or
        ready but not admitted) are stopped.

        Returns:
            rank -> pid of the workers left running (none if the coordinator cannot say
            which are members: then every worker is stopped).
        """
        kept: dict[int, int] = {}
        if self.launcher.outlive:
            try:
                status = self.deployment_status()
                kept = {r: pid for r, pid in self.pids(live_only=True).items()
                        if status.state_of(r) in ACTIVE_STATES and status.rank(r).pid == pid}
            except (ConnectionError, TimeoutError, OSError, ValueError, KeyError) as exc:
                logger.warning("node %d: cannot tell which ranks are members (%s); "
                               "stopping them all", self.node, exc)
            # A member clears its parent-death signal just after it sees itself admitted;
            # exiting before that would take it down with us (the kernel's signal).
            try:
                wait_until(lambda: all(self.launcher.outlived(r) for r in kept), timeout_s,
                           "the kept ranks to stop dying with this process")
            except TimeoutError:
                late = [r for r in kept if not self.launcher.outlived(r)]
                logger.warning("node %d: ranks %s did not confirm they outlive this "
                               "process in %.0f s; they may stop with it", self.node, late,
                               timeout_s)
        self.stop(timeout_s, keep=kept.values())  # also removes the outlive markers
        return kept

    def handed_over(self) -> list[int]:
        """pids of the live members on this node that this process did not start (a
        `join` handed them over, see :meth:`hand_over`), from the coordinator's view;
        [] if it cannot be asked."""
        try:
            status = self.launcher.deployment_status()
        except (ConnectionError, TimeoutError, OSError, ValueError):
            return []
        ours = set(self.pids(live_only=False).values())
        return [r.pid for r in status.ranks
                if r.node == self.node and r.pid is not None and r.pid not in ours
                and r.state in ACTIVE_STATES and pid_alive(r.pid)]

    def stop(self, timeout_s: float = 5.0, keep: Collection[int] = ()) -> None:
        """Kill every worker started here (by pid) but those in ``keep``, then the
        coordinator if ours; idempotent."""
        # A planned stop, not failures: the coordinator stops treating exits as deaths,
        # the workers are killed while it is still up (so none logs a lost coordinator),
        # then it closes. Members a `join` handed over on this node would lose it too:
        # they are stopped with ours.
        handed = self.handed_over() if self.coordinator is not None else []
        self.launcher.detach()
        if isinstance(self._membership, CoordinatorMembership):
            self._membership.close()
        if self.coordinator is not None:
            self.coordinator.begin_stop()
        kill_pids(handed, timeout_s)
        self.launcher.stop(timeout_s, keep)
        for coordinator in (self.coordinator, self.replica):
            if coordinator is not None:
                coordinator.close()

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
