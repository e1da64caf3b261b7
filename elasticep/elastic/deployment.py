"""A local EP deployment: coordinator, N worker processes, and their supervisor.

Used by ``generate --ep-size N`` and by ``serve``::

    dep = LocalDeployment(DeploymentConfig(model=..., ep_size=4, max_ep_size=6,
                                           frontend_request_addr=..., frontend_output_addr=...))
    dep.start()                  # coordinator + ranks 0..3
    dep.wait_healthy(timeout_s=60)
    dep.relaunch(2)              # a dead slot comes back (join mode "recover")
    dep.add_ranks(2)             # scale 4 -> 6 (join mode "scale")
    dep.request_removal([5])     # planned scale-down of slot 5
    dep.status()                 # MembershipSource shape (see entrypoints/membership.py)
    dep.stop()

The coordinator runs on threads of this process, outside every worker, so any rank
(rank 0 included) may die. Workers are fresh interpreters (``sys.executable -m
elasticep.elastic.worker``, never fork), started and watched by
:class:`~elasticep.elastic.launcher.WorkerLauncher`, which reports each death to the
coordinator at once (milliseconds), before the control connection's EOF or the heartbeat
timeout would.
"""

from __future__ import annotations

import logging
import subprocess
from dataclasses import replace
from typing import Any

from elasticep.distributed import start_coordinator
from elasticep.distributed.membership import ScalePhase, SlotState
from elasticep.distributed.status import DeploymentStatus, RankStatus
from elasticep.elastic.config import DeploymentConfig
from elasticep.elastic.launcher import WorkerLauncher, publish_config
from elasticep.utils.wait import wait_until

__all__ = ["LocalDeployment"]

logger = logging.getLogger(__name__)


class LocalDeployment:
    """Coordinator plus supervised worker processes on this machine.

    Args:
        config: the shared settings; the front-end addresses must be set. ``store_addr``
            is filled in by :meth:`start`.
        fault: fault-injection spec passed to the launch cohort (not to relaunches).
        env: extra environment for the workers.
        log_dir: if set, worker ``i``'s stderr goes to ``log_dir/rank{i}.log`` (appended),
            else to this process's stderr.
        hb_interval_s: heartbeat period of the coordinator (seconds).
    """

    def __init__(self, config: DeploymentConfig, *, fault: str | None = None,
                 env: dict[str, str] | None = None, log_dir: str | None = None,
                 hb_interval_s: float = 0.2) -> None:
        if config.elastic_ep_backend == "none" and config.max_ep_size != config.ep_size:
            config = replace(config, max_ep_size=config.ep_size)
        self.config = config
        self.fault = fault
        self.env = env or {}
        self.log_dir = log_dir
        self.hb_interval_s = hb_interval_s
        self.coordinator = None
        self.workers: WorkerLauncher | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the coordinator, publish the config and launch ranks ``0..ep_size-1``.

        Returns at once; use :meth:`wait_healthy` to wait for the workers.
        """
        self.coordinator = start_coordinator(hb_interval_s=self.hb_interval_s,
                                             hb_timeout_s=self.config.heartbeat_timeout_s)
        host = self.coordinator.address.rpartition(":")[0]
        self.config = replace(self.config, store_addr=f"{host}:{self.coordinator.store.port}")
        self.workers = WorkerLauncher(self.coordinator.address, self.config,
                                      log_dir=self.log_dir, env=self.env)
        publish_config(self.coordinator.address, self.config)
        logger.info("deployment: coordinator %s, launching %d ranks (capacity %d, backend %s)",
                    self.coordinator.address, self.config.ep_size, self.config.max_ep_size,
                    self.config.elastic_ep_backend)
        for rank in range(self.config.ep_size):
            self.workers.spawn(rank, None, self.fault)

    @property
    def procs(self) -> dict[int, subprocess.Popen]:
        """rank -> the latest process started for it."""
        return {} if self.workers is None else self.workers.procs

    @property
    def exit_codes(self) -> dict[int, list[int]]:
        """rank -> exit codes of its processes so far, oldest first."""
        return {} if self.workers is None else self.workers.exit_codes

    @property
    def address(self) -> str:
        """``host:port`` of the coordinator (for ``join --dist-init-addr``)."""
        if self.coordinator is None:
            raise RuntimeError("deployment not started")
        return self.coordinator.address

    def stop(self, timeout_s: float = 5.0) -> None:
        """Kill every worker this deployment started (by pid), then the coordinator."""
        # Coordinator first: the workers then see a lost coordinator, not a cascade of
        # failures and repairs, while they are being killed.
        if self.workers is not None:
            self.workers.detach()
        if self.coordinator is not None:
            self.coordinator.close()
        if self.workers is not None:
            self.workers.stop(timeout_s)

    def __enter__(self) -> LocalDeployment:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ workers
    def relaunch(self, rank: int) -> subprocess.Popen:
        """Start a fresh worker for a failed slot (join mode "recover") and ask the ranks
        to admit it once it is ready. A still-running old process is killed first.

        Raises:
            ValueError: the slot is outside the capacity.
        """
        if not 0 <= rank < self.config.max_ep_size:
            raise ValueError(f"rank {rank} outside [0, {self.config.max_ep_size})")
        workers = self._started()
        old = workers.kill(rank, timeout_s=5.0)
        if old is not None:
            old.wait(5)
        workers.spawn(rank, "recover")
        self._call("request_admission", [rank])
        return self.procs[rank]

    def add_ranks(self, count: int) -> list[int]:
        """Scale up: start ``count`` new ranks in free slots (join mode "scale").

        Returns:
            The slots used.

        Raises:
            ValueError: not enough free capacity (``max_ep_size``).
        """
        states = self._states_by_rank()
        free = [r for r in range(self.config.max_ep_size)
                if states.get(r, SlotState.REMOVED) == SlotState.REMOVED and self._exited(r)]
        if len(free) < count:
            raise ValueError(f"only {len(free)} free slots (max_ep_size {self.config.max_ep_size})")
        slots = free[:count]
        for r in slots:
            self._started().spawn(r, "scale")
        self._call("request_admission", slots)
        return slots

    def _exited(self, rank: int) -> bool:
        """No live process of ours holds ``rank``."""
        return self.workers is None or self.workers.exited(rank)

    def request_removal(self, ranks: list[int]) -> None:
        """Planned scale-down: the ranks drain their experts and leave at a step boundary."""
        self._call("request_deactivation", ranks)

    def scale(self, new_ep_size: int) -> dict[str, Any]:
        """Grow (new slots) or shrink (highest ranks first) to ``new_ep_size`` active ranks.

        Raises:
            ValueError: out of range, or the elastic backend is off.
        """
        if self.config.elastic_ep_backend != "elastic":
            raise ValueError("scaling needs elastic_ep_backend='elastic'")
        if not 1 <= new_ep_size <= self.config.max_ep_size:
            raise ValueError(f"new_ep_size must be in [1, {self.config.max_ep_size}]")
        active = self.active_ranks()
        if new_ep_size > len(active):
            return {"added": self.add_ranks(new_ep_size - len(active))}
        leaving = sorted(active)[new_ep_size:]
        if leaving:
            self.request_removal(leaving)
        return {"removing": leaving}

    # ------------------------------------------------------------------ status
    def _started(self) -> WorkerLauncher:
        if self.workers is None:
            raise RuntimeError("deployment not started")
        return self.workers

    def _call(self, method: str, *args: Any) -> Any:
        return self._started().call(method, *args)

    def coordinator_status(self) -> dict[str, Any]:
        """The coordinator's raw snapshot (:meth:`CoordinatorClient.status`)."""
        return self._call("status")

    def _states_by_rank(self) -> dict[int, str]:
        world = self.coordinator_status()["groups"].get("world")
        if world is None:
            return {}
        return {world["ranks"][s]: st for s, st in enumerate(world["states"])}

    def active_ranks(self) -> list[int]:
        """Ranks active in WORLD's committed epoch."""
        world = self.coordinator_status()["groups"].get("world")
        return [] if world is None else [world["ranks"][s] for s in world["active"]]

    def pids(self) -> dict[int, int]:
        """rank -> pid of the latest process started for it."""
        return {} if self.workers is None else self.workers.pids(live_only=False)

    def status(self) -> DeploymentStatus:
        """Membership in the front-end's ``MembershipSource`` shape.

        Before WORLD exists (workers still starting) every launched rank is "joining".
        """
        pids = self.pids()
        cap = self.config.max_ep_size
        if self.config.elastic_ep_backend == "none":
            # No membership, no fault tolerance: a rank is healthy only while every
            # launched rank still runs (plain groups cannot progress without a member).
            state = (SlotState.FAILED if any(self._exited(r) for r in pids)
                     else SlotState.HEALTHY)
            return DeploymentStatus(0, self.config.ep_size, cap, ranks=tuple(
                RankStatus(r, state, pid) for r, pid in sorted(pids.items())))
        st = self.coordinator_status()
        world = st["groups"].get("world")
        procs = st["ranks"]
        if world is None:
            return DeploymentStatus(0, 0, cap, ranks=tuple(
                RankStatus(r, SlotState.JOINING, pids.get(r)) for r in sorted(pids)))
        ranks = []
        for slot, state in enumerate(world["states"]):
            r = world["ranks"][slot]
            if state == SlotState.REMOVED and r not in pids:
                continue  # never-used capacity
            pid = procs.get(str(r), {}).get("pid", pids.get(r))
            ranks.append(RankStatus(r, SlotState(state), pid))
        req = world["requests"]
        phase = (ScalePhase.ADMITTING if req.get("admit") else
                 ScalePhase.DRAINING if req.get("remove") else ScalePhase.IDLE)
        return DeploymentStatus(world["epoch"], len(world["active"]), cap, phase, tuple(ranks))

    def wait_healthy(self, ranks: list[int] | None = None, timeout_s: float = 120.0) -> None:
        """Block until ``ranks`` (default: the launch cohort) are healthy in WORLD.

        Raises:
            TimeoutError: not within ``timeout_s``; RuntimeError: a worker exited.
        """
        want = set(range(self.config.ep_size) if ranks is None else ranks)

        def healthy() -> bool:
            states = ({r: SlotState.HEALTHY for r in self.procs if not self._exited(r)}
                      if self.config.elastic_ep_backend == "none" else self._states_by_rank())
            if all(states.get(r) == SlotState.HEALTHY for r in want):
                return True
            dead = [r for r in want if r in self.procs and self.procs[r].poll() is not None]
            if dead:
                raise RuntimeError(f"ranks {dead} exited during startup: {self.exit_codes}")
            return False

        wait_until(healthy, timeout_s, f"ranks {sorted(want)} healthy")
