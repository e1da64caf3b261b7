"""One `elasticep serve` subprocess, driven only through its documented CLI and HTTP API.

Everything here is bounded: every wait has a timeout and raises :class:`TimeoutError`
naming what it waited for. Only pids this object started (serve, join) or read from
``/elastic_ep_status`` (rank workers), plus their descendants, are ever signalled.

    with ServeProcess.start(["--ep-size", "4"]) as serve:
        serve.wait_for(all_healthy, 30, "four healthy ranks")
        pid = serve.signal_rank(2, signal.SIGKILL)
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai

from elasticep.membership.status import DeploymentStatus, RankStatus
from elasticep.utils.procs import die_with_parent, kill_pids, pid_alive
from elasticep.utils.wait import wait_until
from elasticep_testkit.harness.load import make_client

Status = DeploymentStatus


def parse_rank_metric(text: str, name: str) -> dict[int, float]:
    """``name{rank="R"} V`` lines of a Prometheus text exposition -> {R: V}."""
    out: dict[int, float] = {}
    prefix = name + '{rank="'
    for line in text.splitlines():
        if line.startswith(prefix):
            rank, _, value = line[len(prefix):].partition('"} ')
            out[int(rank)] = float(value)
    return out


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_command(*args: str) -> list[str]:
    """The command line running ``elasticep ARGS`` with this interpreter."""
    return [sys.executable, "-m", "elasticep.entrypoints.cli", *args]


def descendant_pids(root: int) -> set[int]:
    """Live descendants of ``root`` (children, grandchildren, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # exited while we looked
        children.setdefault(ppid, []).append(int(entry))
    out: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def coordinator_pids(root: int) -> set[int]:
    """The coordinator processes (``elasticep.membership.process``, a leader or a
    standby replica) among the live descendants of ``root``."""
    out = set()
    for pid in descendant_pids(root):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"elasticep.membership.process" in f.read().split(b"\0"):
                    out.add(pid)
        except OSError:
            continue  # exited while we looked
    return out


def _stop_with_us() -> None:
    # if this driver dies (even SIGKILL), serve/join get SIGTERM and stop their own
    # workers, so a killed bench or chaos run leaves no deployment behind
    die_with_parent(sig=signal.SIGTERM)


def healthy_ranks(status: Status) -> list[int]:
    """Ranks the status reports ``healthy``."""
    return status.healthy_ranks()


def all_healthy(status: Status) -> bool:
    """True when exactly ``ep_size`` ranks are healthy and no scale is running."""
    return status.all_healthy()


@dataclass(frozen=True)
class Joiner:
    """One `elasticep join` process: ``proc``, its output file, the caller's tag."""

    proc: subprocess.Popen
    log_path: Path
    tag: str

    def output(self) -> str:
        """What it printed so far (stdout and stderr)."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


class ServeProcess:
    """A running `elasticep serve` (use :meth:`start`); a context manager that stops it.

    Attributes:
        proc: the serve process.
        url: ``http://127.0.0.1:PORT`` of its API.
        coordinator: ``127.0.0.1:PORT`` of its coordinator (``--dist-init-addr``).
        log_path: serve's stdout+stderr (worker logs included).
        joins: every `elasticep join` process started through :meth:`join`.
        seen_pids: every pid started or observed (workers, descendants).
    """

    def __init__(self, proc: subprocess.Popen, url: str, coordinator: str,
                 log_path: Path, wrap: tuple[str, ...] = ()) -> None:
        self.proc = proc
        self.wrap = wrap
        self.url = url
        self.coordinator = coordinator
        self.log_path = log_path
        self.joins: list[subprocess.Popen] = []
        self.seen_pids: set[int] = {proc.pid}
        self._http = httpx.Client(base_url=url, timeout=10.0)
        self._model: str | None = None
        self._client: openai.OpenAI | None = None

    @classmethod
    def start(cls, serve_args: list[str], ready_timeout_s: float = 300.0,
              log_dir: str | None = None, host: str = "127.0.0.1",
              wrap: tuple[str, ...] = (), coordinator: str | None = None,
              program: tuple[str, ...] | None = None) -> ServeProcess:
        """Start ``elasticep serve`` on free ports; wait for its ``ready:`` line (every
        initial rank is healthy and connected to the front-end).

        Args:
            serve_args: extra serve flags (``--ep-size 4`` ...); never --port/--host.
            ready_timeout_s: bound on start-up (model load on every rank), seconds.
            log_dir: where serve.log and the workers' ``rank<r>.log`` go (default: a
                fresh temp dir).
            host: the address of the API and the coordinator (127.0.0.1, or a test
                host's address).
            wrap: a command prefix that runs serve and every :meth:`join` elsewhere,
                keeping the pid (``ip netns exec NS``, which execs the command).
            coordinator: ``HOST:PORT`` for the coordinator (default: ``host`` and a free
                port), e.g. one that other nodes were already told.
            program: the command to run instead of ``elasticep serve`` (it takes serve's
                --host, --port, --dist-init-addr and --log-dir, and prints the same
                ``ready:`` line), e.g. the stub-engine server of
                ``elasticep_testkit.serving.stub_serve``.

        Raises:
            RuntimeError: serve exited during start-up (the log tail is in the message).
            TimeoutError: not ready within ``ready_timeout_s``.
        """
        port, coordinator = free_port(), coordinator or f"{host}:{free_port()}"
        log_path = Path(log_dir or tempfile.mkdtemp(prefix="elasticep-serve-")) / "serve.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [*wrap, *(program or cli_command("serve")), "--host", host, "--port", str(port),
                 "--dist-init-addr", coordinator, "--log-dir", str(log_path.parent),
                 *serve_args],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,  # our terminal's Ctrl-C must not reach it
                preexec_fn=_stop_with_us)
        serve = cls(proc, f"http://{host}:{port}", coordinator, log_path, wrap)
        try:
            serve.wait_for(lambda st: all_healthy(st) and serve.printed_ready(),
                           ready_timeout_s, "serve's ready line", poll_s=0.2)
        except BaseException:
            serve.stop(timeout_s=10)
            raise
        return serve

    def printed_ready(self) -> bool:
        """True once serve printed its ``ready:`` line."""
        return any(line.startswith("ready:") for line in self.tail(1 << 20).splitlines())

    # ---- HTTP --------------------------------------------------------------------
    def status(self) -> Status:
        """``GET /elastic_ep_status``; remembers every worker pid it names.

        Raises:
            httpx.HTTPError: the API did not answer (10 s bound).
        """
        body = self._http.get("/elastic_ep_status").raise_for_status().json()
        status = DeploymentStatus.from_dict(body)
        self.seen_pids |= set(status.pids().values())
        return status

    def status_json(self) -> dict:
        """``GET /elastic_ep_status`` as its raw JSON (with what serve adds to the typed
        status: ``frontends``, ``coordinator_replicas``, ``restart_budget``).

        Raises:
            httpx.HTTPError: the API did not answer (10 s bound).
        """
        return self._http.get("/elastic_ep_status").raise_for_status().json()

    def rank_metric(self, name: str) -> dict[int, float]:
        """A per-rank ``/metrics`` gauge (e.g. ``elasticep_cuda_graph_captures``): rank ->
        value, for the ranks that reported it.

        Raises:
            httpx.HTTPError: the API did not answer (10 s bound).
        """
        return parse_rank_metric(self.metrics(), name)

    def metrics(self) -> str:
        """``GET /metrics``: the Prometheus text exposition.

        Raises:
            httpx.HTTPError: the API did not answer (10 s bound).
        """
        return self._http.get("/metrics").raise_for_status().text

    def scale(self, new_ep_size: int) -> tuple[int, dict]:
        """``POST /scale_elastic_ep``; returns (HTTP status code, JSON body)."""
        r = self._http.post("/scale_elastic_ep", json={"new_ep_size": new_ep_size})
        return r.status_code, r.json()

    @property
    def client(self) -> openai.OpenAI:
        """An `openai` client of this server (no retries, 60 s per request)."""
        if self._client is None:
            self._client = make_client(self.url, 60.0)
        return self._client

    def model_name(self) -> str:
        """The served model id from ``GET /v1/models`` (cached)."""
        if self._model is None:
            self._model = self._http.get("/v1/models").raise_for_status().json()["data"][0]["id"]
        return self._model

    def wait_for(self, pred: Callable[[Status], bool], timeout_s: float, what: str,
                 poll_s: float = 0.05, watch: tuple[Joiner, ...] = ()) -> Status:
        """Poll the status until ``pred(status)`` holds; return that status.

        Args:
            watch: `join` processes that must stay alive meanwhile.

        Raises:
            TimeoutError: ``timeout_s`` seconds passed (message names ``what``).
            RuntimeError: serve, or a watched `join` that was running, exited meanwhile.
        """
        last: list[Status | str] = ["no answer yet"]
        live = [j for j in watch if j.proc.poll() is None]

        def check() -> Status | None:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited ({self.proc.returncode}) while waiting for "
                                   f"{what}; log tail:\n{self.tail()}")
            for j in live:
                if j.proc.poll() is not None:
                    raise RuntimeError(f"{j.tag} exited ({j.proc.returncode}) while waiting "
                                       f"for {what}; its output:\n{j.output()[-3000:]}")
            try:
                last[0] = self.status()
            except httpx.HTTPError as exc:  # not listening yet, or busy: retry until bound
                last[0] = repr(exc)
                return None
            return last[0] if pred(last[0]) else None

        return wait_until(check, timeout_s, what, poll_s=poll_s, last=lambda: last[0])

    def rank_state(self, rank: int, status: Status | None = None) -> RankStatus:
        """The status entry of ``rank``."""
        return (status or self.status()).rank(rank)

    # ---- processes ---------------------------------------------------------------
    def signal_rank(self, rank: int, sig: int) -> int:
        """Send ``sig`` to ``rank``'s worker (pid from the status); return the pid.

        Raises:
            LookupError: the status names no pid for ``rank``.
        """
        pid = self.rank_state(rank).pid
        if not pid:
            raise LookupError(f"rank {rank} has no pid in /elastic_ep_status")
        os.kill(pid, sig)
        return pid

    def join(self, *args: str, tag: str = "join", wrap: tuple[str, ...] | None = None,
             coordinator_timeout_s: float | None = None) -> Joiner:
        """Start ``elasticep join --dist-init-addr COORDINATOR ARGS`` (log next to serve's).

        Args:
            wrap: a command prefix (default: serve's; another test host's
                ``ip netns exec NS``).
            coordinator_timeout_s: its ``--coordinator-timeout`` (how long it keeps trying
                a lost coordinator before it exits); None: join's default.
        """
        log_path = self.log_path.with_name(f"{tag}{len(self.joins)}.log")
        wrap = self.wrap if wrap is None else wrap
        if coordinator_timeout_s is not None:
            args = ("--coordinator-timeout", f"{coordinator_timeout_s:g}", *args)
        with open(log_path, "w") as log:
            p = subprocess.Popen([*wrap, *cli_command(
                                     "join", "--dist-init-addr", self.coordinator,
                                     "--log-dir", str(self.log_path.parent), *args)],
                                 stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True, preexec_fn=_stop_with_us)
        self.joins.append(p)
        self.seen_pids.add(p.pid)
        return Joiner(p, log_path, tag)

    def note_descendants(self) -> set[int]:
        """Record (and return) the live descendants of serve and of every join."""
        found: set[int] = set()
        for p in [self.proc, *self.joins]:
            found |= descendant_pids(p.pid)
        self.seen_pids |= found
        return found

    def coordinator_pid(self) -> int | None:
        """The pid of serve's coordinator process (a child of serve running
        ``elasticep.membership.process``), or None if none runs; remembered in
        :attr:`seen_pids`."""
        for pid in sorted(descendant_pids(self.proc.pid)):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue  # exited while we looked
            if b"elasticep.membership.process" in argv:
                self.seen_pids.add(pid)
                return pid
        return None

    def rank_log(self, rank: int) -> str:
        """What worker ``rank`` logged so far (every process of the slot appends to
        ``rank<r>.log`` next to serve.log); "" if nothing yet."""
        try:
            return (self.log_path.parent / f"rank{rank}.log").read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, n_chars: int = 4000) -> str:
        """The end of serve's log."""
        try:
            return self.log_path.read_text(errors="replace")[-n_chars:]
        except OSError:
            return ""

    def interrupt(self, timeout_s: float = 30.0) -> int | None:
        """Ctrl-C serve alone (SIGINT; its joins are left to notice) and wait for it.

        Returns:
            serve's exit code (130 for a clean Ctrl-C), or None if it still runs after
            ``timeout_s`` seconds.
        """
        self.note_descendants()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout_s)
        return self.proc.poll()

    def stop(self, timeout_s: float = 30.0) -> list[int]:
        """Ctrl-C serve (SIGINT) and end the joins (SIGTERM), wait, then force-kill
        anything of ours still alive.

        Returns:
            The orphans: pids this object started or saw that were still alive
            ``timeout_s`` seconds after the graceful stop (they are killed anyway).
        """
        self.note_descendants()
        for p in [self.proc, *self.joins]:
            if p.poll() is None:
                p.send_signal(signal.SIGINT if p is self.proc else signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in [self.proc, *self.joins]:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        # children exit after their supervisor: give them what is left of the bound
        with contextlib.suppress(TimeoutError):
            wait_until(lambda: not any(pid_alive(p) for p in self.seen_pids),
                       max(0.0, deadline - time.monotonic()), "our processes to exit",
                       poll_s=0.1)
        orphans = sorted(p for p in self.seen_pids if pid_alive(p))
        kill_pids(orphans, timeout_s=5.0)
        for p in [self.proc, *self.joins]:
            if p.poll() is None:
                p.kill()
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass
        self._http.close()
        if self._client is not None:
            self._client.close()
        return orphans

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None or any(p.poll() is None for p in self.joins):
            self.stop()
