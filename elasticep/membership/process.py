"""The coordinator in a process of its own, started and watched by `serve` (and
`generate --ep-size`): nothing the front-end does (a GIL hog, a long tokenization, a
stalled event loop, a SIGSTOP) can starve heartbeats, because the coordinator has its
own interpreter, GIL and scheduler slot.

    coord = CoordinatorProcess.start("127.0.0.1", 29400, hb_timeout_s=2.0,
                                     on_exit=lambda code: ...)
    coord.address, coord.store_port, coord.pid
    coord.begin_stop()   # a planned stop: exits from now on are no failures
    coord.close()        # ranks see EOF; the child exits

Everything else (the front-end, the launcher, `join`, the ranks) talks to it over its
control socket (``messages.py``), as it would to a coordinator on another host.

How the child is made:
- The parent binds the control socket and hands the child its file descriptor, so a
  bind error is the parent's own ``OSError`` and the address is known at once. Only
  the child listens on it, once it serves: until then a connect is refused, as to a
  coordinator not up yet, so that other nodes and `join` retry instead of taking a
  connection that never answers for something that does not speak the protocol.
- The child is a fresh interpreter (``python -m elasticep.membership.process``, what
  multiprocessing's ``spawn`` does): never a plain fork of a process whose threads may
  hold locks.
- It runs in its own session, so a terminal's Ctrl-C reaches only the parent, which
  stops the ranks first and the coordinator last.

The lifeline is the child's stdin and stdout, one line each way:
- parent -> child: ``begin_stop``; child -> parent: ``stopping`` once it is applied;
- child -> parent, once: ``{"address": ..., "store_port": ...}`` when it serves.
EOF on stdin (the parent closed it, or died: the kernel closes a dead process's files)
closes the coordinator and ends the child. So does a change of its parent pid (it was
re-parented), in case another process holds a copy of the pipe. The child never
outlives its parent.

If the child dies, ``on_exit(code)`` runs on a watcher thread. With the embedded store
the membership it held (epochs, slot states, the rendezvous store) died with it, and a
new coordinator could not take the ranks back in the same epochs, so the owner stops
the deployment with an error instead of restarting the coordinator.

With ``--membership-store etcd://...`` every node runs a replica (``standby=True``: it
campaigns for the leader lease until elected, then restores the state from etcd and
serves; its ready line comes then). It campaigns while torch, which only the
rendezvous store needs, still loads (``candidacy.py``). The ranks find the leader through etcd, so the
owner replaces a dead replica with a fresh standby (``deploy/coordinator_replica.py``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, TYPE_CHECKING

from elasticep.enums import StrEnum
from elasticep.utils.net import bind_tcp

from .candidacy import BackgroundImport, defer_while_loading
from .errors import MembershipStoreError

if TYPE_CHECKING:  # imported on a thread of its own (torch): see main()
    from .server import Coordinator

log = logging.getLogger("elasticep.membership")

MODULE = "elasticep.membership.process"

# A fresh interpreter imports torch (the TCPStore): seconds on a loaded 2-core host.
READY_TIMEOUT_S = 120.0
# How often the child checks that its parent is still the process that started it.
PARENT_POLL_S = 0.5


class Lifeline(StrEnum):
    """The words of the lifeline (one per line; the ready line is JSON)."""

    BEGIN_STOP = "begin_stop"  # parent -> child: a planned stop begins
    STOPPING = "stopping"      # child -> parent: begin_stop is applied


class _Lines:
    """Lines read from a pipe, each with a deadline (``select``, so a child that says
    nothing never holds the reader past it)."""

    def __init__(self, pipe: IO[bytes]) -> None:
        self._fd = pipe.fileno()
        self._buf = b""

    def next(self, timeout_s: float) -> str | None:
        """The next line without its newline; None at EOF (the child exited).

        Raises:
            TimeoutError: no full line within ``timeout_s`` seconds.
        """
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no line from the coordinator process in {timeout_s:g} s")
            if not select.select([self._fd], [], [], left)[0]:
                continue
            chunk = os.read(self._fd, 4096)
            if not chunk:
                return None
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode()


class CoordinatorProcess:
    """A coordinator running as a child process (see the module docstring). Use
    :meth:`start`.

    Attributes:
        address: its control endpoint, ``"host:port"``.
        store_port: the port of its rendezvous TCPStore (on the same host).
    """

    def __init__(self, proc: subprocess.Popen, address: str, store_port: int | None,
                 on_exit: Callable[[int], None] | None) -> None:
        self._proc = proc
        self._lines = _Lines(proc.stdout)
        self.address = address
        self.store_port = store_port
        self._on_exit = on_exit
        self._closing = False
        self._lock = threading.Lock()  # one lifeline exchange at a time
        threading.Thread(target=self._watch, daemon=True, name="coord-proc-watch").start()
        if store_port is None:  # a standby: it serves once elected
            threading.Thread(target=self._await_lead, daemon=True,
                             name="coord-proc-standby").start()

    @property
    def leads(self) -> bool:
        """The child serves (it was elected, or it is the embedded coordinator)."""
        return self.store_port is not None

    @classmethod
    def start(cls, host: str = "127.0.0.1", port: int = 0, *, hb_interval_s: float = 0.2,
              hb_timeout_s: float = 2.0, join_hb_timeout_s: float = 30.0,
              ready_timeout_s: float = READY_TIMEOUT_S,
              on_exit: Callable[[int], None] | None = None,
              membership_store: str | None = None,
              deployment_id: str | None = None, standby: bool = False,
              ) -> CoordinatorProcess:
        """Start the child and wait until it serves (a ``standby``: only until it runs).

        Args:
            host, port: the control endpoint (port 0: a free one), bound here.
            hb_interval_s, hb_timeout_s, join_hb_timeout_s: as for
                :class:`~elasticep.membership.server.Coordinator` (seconds).
            ready_timeout_s: bound on the child's start-up (seconds).
            on_exit: called with the child's exit status (negative: a signal) if it
                ends before :meth:`close`, from a watcher thread.
            membership_store: ``--membership-store`` (``etcd://...``; None: embedded):
                the child claims its prefix for ``deployment_id``, campaigns for the
                leader lease and commits the membership there after each change.
            standby: (etcd only) a replica that campaigns until elected, claims
                nothing, and takes the state over from etcd once elected; this returns
                at once (:attr:`leads` tells when it serves).

        Raises:
            OSError: ``host:port`` cannot be bound, or the child exited before it
                served (its own error is on this process's stderr, which it shares).
            TimeoutError: it did not serve within ``ready_timeout_s``.
        """
        listener = bind_tcp(host, port, socket.AF_INET)  # as socket.create_server binds
        address = f"{host}:{listener.getsockname()[1]}"
        cmd = [sys.executable, "-m", MODULE, "--host", host,
               "--listen-fd", str(listener.fileno()), "--parent-pid", str(os.getpid()),
               "--hb-interval-s", repr(hb_interval_s), "--hb-timeout-s", repr(hb_timeout_s),
               "--join-hb-timeout-s", repr(join_hb_timeout_s)]
        if membership_store and membership_store != "embedded":
            cmd += ["--membership-store", membership_store,
                    "--deployment-id", deployment_id or "elasticep"]
            cmd += ["--standby"] if standby else []
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    pass_fds=(listener.fileno(),), start_new_session=True)
        finally:
            listener.close()  # the child holds its own copy
        if standby:
            log.info("coordinator replica pid %d at %s: standby", proc.pid, address)
            return cls(proc, address, None, on_exit)
        try:
            line = _Lines(proc.stdout).next(ready_timeout_s)
            if line is None:
                raise OSError(f"the coordinator process exited with {proc.wait(10)} before "
                              "it served")
            store_port = int(json.loads(line)["store_port"])
        except BaseException:
            # it has not served, so nothing depends on it; and a child still importing
            # acts on neither the lifeline's EOF nor SIGTERM until its imports end
            _kill(proc)
            raise
        log.info("coordinator process pid %d serves at %s (store port %d)", proc.pid,
                 address, store_port)
        return cls(proc, address, store_port, on_exit)

    @property
    def pid(self) -> int:
        """The child's pid."""
        return self._proc.pid

    def exit_code(self) -> int | None:
        """The child's exit status if it ended on its own (not through :meth:`close`);
        None while it runs."""
        code = self._proc.poll()
        return None if self._closing else code

    def begin_stop(self, timeout_s: float = 5.0) -> bool:
        """Tell the coordinator the deployment is being stopped on purpose (exits and
        silences are no failures from now on); call before killing the ranks.

        Returns:
            True once the child confirmed it; False if it is gone or did not answer
            within ``timeout_s`` seconds (the stop goes on without it).
        """
        with self._lock:
            if self._proc.poll() is not None or not self.leads:
                return False  # a standby holds no ranks: nothing to tell it
            try:
                self._proc.stdin.write(f"{Lifeline.BEGIN_STOP}\n".encode())
                self._proc.stdin.flush()
                return self._lines.next(timeout_s) == Lifeline.STOPPING
            except (OSError, TimeoutError, ValueError) as exc:
                log.warning("coordinator process pid %d: begin_stop unanswered (%s)",
                            self._proc.pid, exc)
                return False

    def close(self, timeout_s: float = 5.0) -> None:
        """Close the lifeline: the child closes the coordinator (ranks see EOF) and
        exits; killed if it has not after ``timeout_s`` seconds. Idempotent."""
        self._closing = True
        with self._lock:
            try:
                self._proc.stdin.close()
            except OSError:
                pass
        _end(self._proc, timeout_s)
        self._proc.stdout.close()

    def _await_lead(self) -> None:
        """A standby's ready line comes once it is elected and serves (read in short
        turns, so that :meth:`close` is never held up)."""
        while not self._closing:
            with self._lock:
                try:
                    line = self._lines.next(0.2)
                except (TimeoutError, ValueError, OSError):
                    continue
            if line is None:
                return  # it exited: the watcher reports it
            self.store_port = int(json.loads(line)["store_port"])
            log.warning("coordinator replica pid %d at %s leads now (store port %d)",
                        self._proc.pid, self.address, self.store_port)
            return

    def _watch(self) -> None:
        code = self._proc.wait()
        if self._closing:
            return
        log.error("coordinator process pid %d exited with %d (%s)", self._proc.pid, code,
                  "it led" if self.leads else "a standby")
        if self._on_exit is not None:
            self._on_exit(code)


def _end(proc: subprocess.Popen, timeout_s: float) -> None:
    """Wait ``timeout_s`` seconds for our child ``proc`` to exit, then kill it."""
    try:
        proc.wait(timeout_s)
        return
    except subprocess.TimeoutExpired:
        log.warning("coordinator process pid %d still runs %g s after its lifeline "
                    "closed; killing it", proc.pid, timeout_s)
    _kill(proc)


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL our child ``proc`` and reap it (SIGCONT first: a stopped process keeps a
    SIGKILL pending until it runs)."""
    proc.send_signal(signal.SIGCONT)
    proc.kill()
    try:
        proc.wait(10.0)
    except subprocess.TimeoutExpired:
        log.error("coordinator process pid %d survived SIGKILL for 10 s", proc.pid)


# ---------------------------------------------------------------------- the child
def _read_lifeline(begin_stop: Callable[[], None], stop: threading.Event,
                   answer: Callable[[str], None]) -> None:
    """Serve the parent's commands until EOF on stdin (the parent closed it or died).

    Reads stdin unbuffered: a daemon thread blocked in a buffered read holds the
    buffer's lock, and the interpreter, exiting while this thread still waits (a
    deposed coordinator steps down with its parent alive), aborts on that lock
    (SIGABRT, "could not acquire lock ... at interpreter shutdown")."""
    with os.fdopen(os.dup(sys.stdin.fileno()), "rb", buffering=0) as lifeline:
        for raw in iter(lifeline.readline, b""):
            word = raw.decode(errors="replace").strip()
            if word == Lifeline.BEGIN_STOP:
                begin_stop()
                answer(Lifeline.STOPPING)
            elif word:
                log.warning("coordinator: unknown lifeline command %r ignored", word)
    stop.set()


def main(argv: list[str] | None = None) -> int:
    """The child: serve on the inherited listener until the lifeline ends, SIGTERM or
    SIGINT, or the parent is gone. Returns the exit status."""
    ap = argparse.ArgumentParser(description="ElasticEP coordinator (a child of serve)")
    ap.add_argument("--host", required=True)
    ap.add_argument("--listen-fd", type=int, required=True)
    ap.add_argument("--parent-pid", type=int, required=True)
    ap.add_argument("--hb-interval-s", type=float, required=True)
    ap.add_argument("--hb-timeout-s", type=float, required=True)
    ap.add_argument("--join-hb-timeout-s", type=float, required=True)
    ap.add_argument("--membership-store", default=None)
    ap.add_argument("--deployment-id", default="elasticep")
    ap.add_argument("--standby", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s: %(levelname)s %(message)s")
    if os.getppid() != args.parent_pid:  # the parent died while we started
        return 1
    from .election import campaign_for  # etcd's client, not torch
    if args.membership_store:
        # before torch's import starts in its thread: two threads importing one package
        # (etcd3gw's and torch's both reach multiprocessing) can hand one of them the
        # package half-initialized, and the coordinator then died with an AttributeError
        from . import directory, etcd_store, lease_watch, store  # noqa: F401
    # torch (the rendezvous TCPStore) loads beside the campaign: seconds on a loaded
    # host, which a replica replacing a dead one would otherwise spend as no candidate
    server = BackgroundImport("elasticep.membership.server")

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    serving: list[Coordinator] = []
    out_lock = threading.Lock()

    def answer(line: str) -> None:
        try:
            with out_lock:
                sys.stdout.write(f"{line}\n")
                sys.stdout.flush()
        except OSError:  # the parent is gone; the lifeline's EOF follows
            pass

    def begin_stop() -> None:
        if serving:
            serving[0].begin_stop()

    threading.Thread(target=_read_lifeline, args=(begin_stop, stop, answer),
                     daemon=True, name="coord-lifeline").start()

    def gone() -> bool:
        return stop.is_set() or os.getppid() != args.parent_pid

    store = lease = listed = None
    if args.membership_store:
        from .etcd_store import EtcdMembershipStore
        from .lease_watch import LiveRanks
        from .store import parse_store_url

        try:
            port = socket.socket(fileno=os.dup(args.listen_fd))
            address = f"{args.host}:{port.getsockname()[1]}"
            port.close()
            # watching from now on: a standby sees the ranks' leases run out with the
            # leader's (a client of its own: the lease and the persister use theirs)
            listed = LiveRanks(EtcdMembershipStore(parse_store_url(args.membership_store)),
                               address).start()
            if args.standby:
                defer_while_loading(args.membership_store, server.done, gone)
            store, lease = campaign_for(args.membership_store, args.deployment_id,
                                        args.hb_timeout_s, address,
                                        gone if args.standby else None,
                                        on_deposed=lambda _who: stop.set())
        except (MembershipStoreError, TimeoutError) as e:
            print(f"elasticep coordinator: error: {e}", file=sys.stderr, flush=True)
            return 2
        if lease is None:
            return 0  # a standby told to stop before it was elected
    try:
        coord = server.module().Coordinator(args.host, hb_interval_s=args.hb_interval_s,
                            hb_timeout_s=args.hb_timeout_s,
                            join_hb_timeout_s=args.join_hb_timeout_s,
                            listener=socket.socket(fileno=args.listen_fd),
                            membership_store=store, lease=lease, rank_processes=listed)
    except MembershipStoreError as e:  # etcd went away between the claim and the load
        print(f"elasticep coordinator: error: {e}", file=sys.stderr, flush=True)
        return 2
    serving.append(coord)
    answer(json.dumps({"address": coord.address, "store_port": coord.store.port}))
    while not stop.wait(PARENT_POLL_S):
        if os.getppid() != args.parent_pid:
            log.warning("coordinator: parent pid %d is gone; closing", args.parent_pid)
            break
    coord.close()  # deposed: its ranks see EOF and resume with the leader
    if lease is not None:
        lease.resign()
    return 0


if __name__ == "__main__":
    sys.exit(main())
