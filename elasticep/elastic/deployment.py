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
elasticep.elastic.worker``, never fork). One waiter thread per worker blocks in
``Popen.wait`` and reports the death to the coordinator at once (milliseconds), before
the control connection's EOF or the heartbeat timeout would. Popen runs on one
long-lived spawner thread: a worker's ``PR_SET_PDEATHSIG`` fires when the *thread* that
spawned it exits, so spawning from a short-lived thread would kill the worker.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import replace
from typing import IO, Any

from elasticep.distributed import CoordinatorClient, start_coordinator
from elasticep.elastic.config import DeploymentConfig, WorkerConfig
from elasticep.utils.procs import kill_pids

logger = logging.getLogger(__name__)

CONFIG_KEY = "elasticep/deployment_config"


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
        self.procs: dict[int, subprocess.Popen] = {}
        self.exit_codes: dict[int, list[int]] = {}
        self._client: CoordinatorClient | None = None
        self._lock = threading.Lock()
        self._stopping = False
        self._spawner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ep-spawn")
        self._logs: list[IO] = []

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the coordinator, publish the config and launch ranks ``0..ep_size-1``.

        Returns at once; use :meth:`wait_healthy` to wait for the workers.
        """
        self.coordinator = start_coordinator(hb_interval_s=self.hb_interval_s,
                                             hb_timeout_s=self.config.heartbeat_timeout_s)
        host = self.coordinator.address.rpartition(":")[0]
        self.config = replace(self.config, store_addr=f"{host}:{self.coordinator.store.port}")
        self.coordinator.store.set(CONFIG_KEY, self.config.to_json())
        self._client = CoordinatorClient(self.coordinator.address)
        logger.info("deployment: coordinator %s, launching %d ranks (capacity %d, backend %s)",
                    self.coordinator.address, self.config.ep_size, self.config.max_ep_size,
                    self.config.elastic_ep_backend)
        for rank in range(self.config.ep_size):
            self._spawn(rank, None, self.fault)

    @property
    def address(self) -> str:
        """``host:port`` of the coordinator (for ``join --dist-init-addr``)."""
        if self.coordinator is None:
            raise RuntimeError("deployment not started")
        return self.coordinator.address

    def stop(self, timeout_s: float = 5.0) -> None:
        """Kill every worker this deployment started (by pid), then the coordinator."""
        with self._lock:
            self._stopping = True
            pids = [p.pid for p in self.procs.values() if p.poll() is None]
        # Coordinator first: the workers then see a lost coordinator, not a cascade of
        # failures and repairs, while they are being killed.
        if self._client is not None:
            self._client.close()
        if self.coordinator is not None:
            self.coordinator.close()
        kill_pids(pids, timeout_s)
        self._spawner.shutdown(wait=True)
        for f in self._logs:
            f.close()

    def __enter__(self) -> LocalDeployment:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ workers
    def _spawn(self, rank: int, join_mode: str | None, fault: str | None) -> subprocess.Popen:
        wc = WorkerConfig(self.config, rank, self.address, join_mode=join_mode, fault=fault)
        cmd = [sys.executable, "-m", "elasticep.elastic.worker", "--config-json", wc.to_json()]
        env = {**os.environ, **self.env}
        if fault is None:
            env.pop("ELASTICEP_FAULT", None)  # a relaunch must not crash again
        stderr = None
        if self.log_dir is not None:
            os.makedirs(self.log_dir, exist_ok=True)
            stderr = open(os.path.join(self.log_dir, f"rank{rank}.log"), "a")  # noqa: SIM115
            self._logs.append(stderr)
        proc = self._spawner.submit(subprocess.Popen, cmd, env=env, stdin=subprocess.DEVNULL,
                                    stdout=stderr, stderr=stderr).result()
        with self._lock:
            self.procs[rank] = proc
        threading.Thread(target=self._wait_child, args=(rank, proc), daemon=True,
                         name=f"ep-wait-r{rank}").start()
        logger.info("deployment: rank %d started (pid %d, join_mode=%s)", rank, proc.pid, join_mode)
        return proc

    def _wait_child(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        with self._lock:
            self.exit_codes.setdefault(rank, []).append(code)
            stopping = self._stopping
            client = self._client
        if stopping or client is None:
            return
        logger.warning("deployment: rank %d (pid %d) exited with %d", rank, proc.pid, code)
        try:
            with self._lock:  # one request at a time on the client's connection
                client.report_death(rank, pid=proc.pid)
        except (ValueError, OSError, TimeoutError) as exc:
            logger.warning("deployment: could not report rank %d's death: %s", rank, exc)

    def relaunch(self, rank: int) -> subprocess.Popen:
        """Start a fresh worker for a failed slot (join mode "recover") and ask the ranks
        to admit it once it is ready. A still-running old process is killed first.

        Raises:
            ValueError: the slot is outside the capacity.
        """
        if not 0 <= rank < self.config.max_ep_size:
            raise ValueError(f"rank {rank} outside [0, {self.config.max_ep_size})")
        old = self.procs.get(rank)
        if old is not None and old.poll() is None:
            kill_pids([old.pid])
            old.wait(5)
        proc = self._spawn(rank, "recover", None)
        self._call("request_admission", [rank])
        return proc

    def add_ranks(self, count: int) -> list[int]:
        """Scale up: start ``count`` new ranks in free slots (join mode "scale").

        Returns:
            The slots used.

        Raises:
            ValueError: not enough free capacity (``max_ep_size``).
        """
        states = self._states_by_rank()
        free = [r for r in range(self.config.max_ep_size)
                if states.get(r, "removed") == "removed" and self._exited(r)]
        if len(free) < count:
            raise ValueError(f"only {len(free)} free slots (max_ep_size {self.config.max_ep_size})")
        slots = free[:count]
        for r in slots:
            self._spawn(r, "scale", None)
        self._call("request_admission", slots)
        return slots

    def _exited(self, rank: int) -> bool:
        """No live process of ours holds ``rank``."""
        proc = self.procs.get(rank)
        return proc is None or proc.poll() is not None

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
    def _call(self, method: str, *args: Any) -> Any:
        if self._client is None:
            raise RuntimeError("deployment not started")
        with self._lock:
            return getattr(self._client, method)(*args)

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
        with self._lock:
            return {r: p.pid for r, p in self.procs.items()}

    def status(self) -> dict[str, Any]:
        """Membership in the front-end's ``MembershipSource`` shape::

            {"epoch", "ep_size", "max_ep_size", "scale_phase",
             "ranks": [{"rank", "state", "pid", "node"}]}

        Before WORLD exists (workers still starting) every launched rank is "joining".
        """
        pids = self.pids()
        if self.config.elastic_ep_backend == "none":  # no membership: alive = healthy
            ranks = [{"rank": r, "state": "failed" if self._exited(r) else "healthy",
                      "pid": pid, "node": 0} for r, pid in sorted(pids.items())]
            return {"epoch": 0, "ep_size": self.config.ep_size,
                    "max_ep_size": self.config.max_ep_size, "scale_phase": "idle", "ranks": ranks}
        st = self.coordinator_status()
        world = st["groups"].get("world")
        procs = st["ranks"]
        ranks = []
        if world is None:
            ranks = [{"rank": r, "state": "joining", "pid": pids.get(r), "node": 0}
                     for r in sorted(pids)]
            return {"epoch": 0, "ep_size": 0, "max_ep_size": self.config.max_ep_size,
                    "scale_phase": "idle", "ranks": ranks}
        for slot, state in enumerate(world["states"]):
            r = world["ranks"][slot]
            if state == "removed" and r not in pids:
                continue  # never-used capacity
            pid = procs.get(str(r), {}).get("pid", pids.get(r))
            ranks.append({"rank": r, "state": state, "pid": pid, "node": 0})
        req = world["requests"]
        phase = ("admitting" if req.get("admit") else "draining" if req.get("remove")
                 else "idle")
        return {"epoch": world["epoch"], "ep_size": len(world["active"]),
                "max_ep_size": self.config.max_ep_size, "scale_phase": phase, "ranks": ranks}

    def wait_healthy(self, ranks: list[int] | None = None, timeout_s: float = 120.0) -> None:
        """Block until ``ranks`` (default: the launch cohort) are healthy in WORLD.

        Raises:
            TimeoutError: not within ``timeout_s``; RuntimeError: a worker exited.
        """
        want = set(range(self.config.ep_size) if ranks is None else ranks)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            states = ({r: "healthy" for r in self.procs if not self._exited(r)}
                      if self.config.elastic_ep_backend == "none" else self._states_by_rank())
            if all(states.get(r) == "healthy" for r in want):
                return
            dead = [r for r in want if r in self.procs and self.procs[r].poll() is not None]
            if dead:
                raise RuntimeError(f"ranks {dead} exited during startup: {self.exit_codes}")
            time.sleep(0.05)
        raise TimeoutError(f"ranks {sorted(want)} not healthy after {timeout_s}s")
