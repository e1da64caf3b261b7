"""`elasticep join`: start ranks that join a running deployment, and watch them.

Two modes (flags named as in SGLang):

* recover (alias --elastic-ep-rejoin): relaunch failed slots. An evicted worker of that
  slot that is still alive on this machine (frozen) is killed first. The new rank loads
  (the slot still shows failed), registers (joining), reports ready, and is admitted at a
  step boundary (healthy).
* scale: start ranks in free capacity (serve --max-ep-size); they wait in "ready" until
  POST /scale_elastic_ep {"new_ep_size": K} admits them.

Everything else (model, dtype, device, EP settings, front-end addresses) comes from the
coordinator. The command stays in the foreground; Ctrl-C stops the ranks it started.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from elasticep.entrypoints.validate import add_load_format_argument

logger = logging.getLogger("elasticep.join")

EXAMPLES = """\
examples:
  elasticep join --dist-init-addr 127.0.0.1:29400 --elastic-ep-join-mode recover --ranks 2
  elasticep join --dist-init-addr 127.0.0.1:29400 --elastic-ep-rejoin --ranks 2
  elasticep join --dist-init-addr 127.0.0.1:29400 --elastic-ep-join-mode scale \\
      --elastic-ep-join-rank-offset 4 --nranks 2        # or: --ranks 4,5
  curl -X POST localhost:30000/scale_elastic_ep -H 'Content-Type: application/json' \\
      -d '{"new_ep_size": 6}'
"""

# slot states a joiner may take, per mode
_TAKES = {"recover": ("failed",), "scale": ("removed",)}


# one claim per slot in the coordinator's store while a `join` launches and watches it
RESERVATION_KEY = "elasticep/join_reservation/{rank}"
RESERVATION_REFRESH_S = 1.0
RESERVATION_STALE_S = 10.0


class JoinError(ValueError):
    """The join cannot proceed (bad flags or an occupied slot); exit status 2."""


class Reservations:
    """Atomic claims on slots (store keys ``elasticep/join_reservation/<rank>``), so two
    ``join`` commands cannot both launch a worker for one slot.

    A claim is the token ``host:pid:unix_time`` of the owning ``join``; the owner rewrites
    it every ``RESERVATION_REFRESH_S`` and clears it once its rank is in (or it gives up).
    A claim is stale (its owner is gone) when its pid is dead on this host, or it has not
    been refreshed for ``RESERVATION_STALE_S`` and still has not changed after two more
    refresh periods; a stale claim is taken over with ``compare_set`` on its old value.

    Args:
        store: the coordinator's store (``compare_set`` is atomic there).
        host, pid: this owner (default: this host and process).
        clock: wall clock (seconds); sleep: waits before a takeover (tests pass fakes).
    """

    def __init__(self, store, host: str | None = None, pid: int | None = None,
                 clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self._store = store
        self.host = host or socket.gethostname()
        self.pid = os.getpid() if pid is None else pid
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._tokens: dict[int, str] = {}  # rank -> the token we hold
        self._stop = threading.Event()

    def _token(self) -> str:
        return f"{self.host}:{self.pid}:{self._clock():.3f}"

    def _cas(self, rank: int, old: str, new: str) -> str:
        return self._store.compare_set(RESERVATION_KEY.format(rank=rank), old, new).decode()

    def _stale(self, held: str) -> tuple[bool, bool]:
        """(stale, confirm_by_waiting) for a claim someone else holds."""
        from elasticep.utils.procs import pid_alive

        try:
            host, pid, stamp = held.rsplit(":", 2)
            pid_i, stamp_f = int(pid), float(stamp)
        except ValueError:
            return True, True  # not a token of ours: treat as an abandoned claim
        if host == self.host and not pid_alive(pid_i):
            return True, False
        return abs(self._clock() - stamp_f) > RESERVATION_STALE_S, True

    @staticmethod
    def describe(held: str) -> str:
        host, _, rest = held.partition(":")
        return f"elasticep join pid {rest.partition(':')[0]} on {host}"

    def acquire(self, ranks: list[int]) -> None:
        """Claim every slot of ``ranks`` or none.

        Raises:
            JoinError: a slot is claimed by a live ``join``.
        """
        try:
            for r in ranks:
                mine = self._token()
                held = self._cas(r, "", mine)
                if held != mine:
                    mine = self._take_over(r, held)
                with self._lock:
                    self._tokens[r] = mine
        except BaseException:
            self.release()
            raise

    def _take_over(self, rank: int, held: str) -> str:
        """Take over ``rank``'s claim ``held`` if it is stale; returns our token.

        Raises:
            JoinError: its owner is alive (or someone else took it over first).
        """
        stale, wait = self._stale(held)
        if stale:
            if wait:  # a live owner would rewrite it meanwhile, failing the compare_set
                self._sleep(2.5 * RESERVATION_REFRESH_S)
            mine = self._token()
            now = self._cas(rank, held, mine)
            if now == "":  # its owner released it meanwhile
                now = self._cas(rank, "", mine)
            if now == mine:
                logger.warning("rank %d: took over the stale join reservation %r", rank, held)
                return mine
            held = now
        raise JoinError(f"rank {rank} is already being joined ({self.describe(held)})")

    def refresh(self) -> None:
        """Rewrite the time stamp of every claim held; a claim lost to a takeover is dropped."""
        with self._lock:
            for r, old in list(self._tokens.items()):
                new = self._token()
                if self._cas(r, old, new) == new:
                    self._tokens[r] = new
                else:
                    logger.warning("rank %d: our join reservation was taken over", r)
                    del self._tokens[r]

    def keep_alive(self) -> None:
        """Refresh on a daemon thread until :meth:`release`."""
        def loop() -> None:
            while not self._stop.wait(RESERVATION_REFRESH_S):
                try:
                    self.refresh()
                except (RuntimeError, OSError) as exc:  # the coordinator went away
                    logger.debug("join reservation refresh failed: %s", exc)
        threading.Thread(target=loop, daemon=True, name="join-reservation").start()

    def release(self) -> None:
        """Clear the claims we still hold; idempotent."""
        self._stop.set()
        with self._lock:
            tokens, self._tokens = self._tokens, {}
        for r, token in tokens.items():
            try:
                self._cas(r, token, "")
            except (RuntimeError, OSError) as exc:
                logger.debug("rank %d: could not clear the join reservation: %s", r, exc)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``join`` subcommand."""
    p = subparsers.add_parser(
        "join", help="add ranks to a running deployment (rejoin a failed rank, or scale up)",
        description=__doc__.split("\n\n", 1)[1].rsplit("\n\n", 1)[0], epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dist-init-addr", required=True,
                   help="HOST:PORT of the deployment's coordinator (printed by serve)")
    p.add_argument("--elastic-ep-join-mode", choices=("recover", "scale"), default=None,
                   help="recover: relaunch failed ranks; scale: new ranks in free capacity")
    p.add_argument("--elastic-ep-rejoin", action="store_true",
                   help="alias of --elastic-ep-join-mode recover")
    p.add_argument("--ranks", default=None, help="slots to start: '2' or '4,5'")
    p.add_argument("--elastic-ep-join-rank-offset", type=int, default=None,
                   help="first slot to start (with --nranks)")
    p.add_argument("--nranks", type=int, default=None,
                   help="how many consecutive slots from the offset (default 1)")
    p.add_argument("--node-rank", type=int, default=0,
                   help="this machine's node index, shown in /elastic_ep_status")
    p.add_argument("--log-dir", default=None,
                   help="where worker logs go (default: a new temporary directory)")
    add_load_format_argument(p, default=None,
                             help_suffix=" (default: the deployment's; a different one is "
                                         "refused)")
    return p


def parse_mode_and_ranks(args: argparse.Namespace) -> tuple[str, list[int]]:
    """The join mode and the slots, from the flags (no I/O).

    Raises:
        JoinError: missing or contradictory flags.
    """
    mode = args.elastic_ep_join_mode
    if args.elastic_ep_rejoin:
        if mode == "scale":
            raise JoinError("--elastic-ep-rejoin means recover mode; it contradicts "
                            "--elastic-ep-join-mode scale")
        mode = "recover"
    if mode is None:
        raise JoinError("give --elastic-ep-join-mode recover|scale (or --elastic-ep-rejoin)")
    offset = args.elastic_ep_join_rank_offset
    if args.ranks is not None and (offset is not None or args.nranks is not None):
        raise JoinError("give either --ranks or --elastic-ep-join-rank-offset/--nranks")
    if args.ranks is not None:
        try:
            ranks = [int(r) for r in args.ranks.split(",") if r.strip()]
        except ValueError:
            raise JoinError(f"--ranks must be integers like '2' or '4,5', got "
                            f"{args.ranks!r}") from None
    elif offset is not None:
        n = 1 if args.nranks is None else args.nranks
        if n < 1:
            raise JoinError(f"--nranks must be >= 1, got {n}")
        ranks = list(range(offset, offset + n))
    else:
        raise JoinError("give the slots: --ranks 2, --ranks 4,5, or "
                        "--elastic-ep-join-rank-offset 4 --nranks 2")
    if not ranks or len(set(ranks)) != len(ranks) or min(ranks) < 0:
        raise JoinError(f"slots must be distinct non-negative integers, got {ranks}")
    return mode, sorted(ranks)


def check_slots(mode: str, ranks: list[int], max_ep_size: int, snapshot: dict,
                ep_size: int | None = None,
                launched_pid: Callable[[int], int | None] = lambda _r: None) -> None:
    """Refuse slots outside the capacity (recover: outside the target ``ep_size``), not free
    for ``mode``, or already being joined (pure).

    Args:
        snapshot: ``CoordinatorClient.status()``.
        ep_size: the deployment's current target size (None: not checked).
        launched_pid: rank -> pid of a worker some launcher started and that has not
            exited (``RankDirectory.launched_pid``): a failed or free slot with a worker
            still loading is being joined (by ``serve --restart-failed-ranks`` or another
            ``join``), exactly as ``/elastic_ep_status`` shows it.

    Raises:
        JoinError: with the slot, its state and pid.
    """
    from elasticep.entrypoints.coordinator_membership import status_from_snapshot

    world = snapshot.get("groups", {}).get("world")
    if world is None:
        raise JoinError("the deployment has no ranks yet; wait for serve's ready line")
    shown = status_from_snapshot(snapshot, ep_size or 0, max_ep_size, "idle", lambda _r: 0,
                                 launched_pid)["ranks"]
    for r in ranks:
        if not 0 <= r < max_ep_size:
            raise JoinError(f"rank {r} is outside the capacity [0, {max_ep_size}) "
                            f"(serve --max-ep-size)")
        slot = world["ranks"].index(r)
        state = world["states"][slot]
        pid = snapshot.get("ranks", {}).get(str(r), {}).get("pid")
        if state in ("joining", "ready") or shown[slot]["state"] == "joining":
            pid = pid if state in ("joining", "ready") else shown[slot]["pid"]
            raise JoinError(f"rank {r} is already being joined (pid {pid})")
        if mode == "recover" and ep_size is not None and r >= ep_size:
            raise JoinError(f"rank {r} is outside ep_size {ep_size}; use "
                            "--elastic-ep-join-mode scale")
        if state in _TAKES[mode]:
            continue
        if state == "removed":
            raise JoinError(f"rank {r} is free capacity (or was removed by a scale-down); "
                            "use --elastic-ep-join-mode scale and POST /scale_elastic_ep")
        if state == "failed":
            raise JoinError(f"rank {r} has failed; relaunch it with "
                            "--elastic-ep-join-mode recover")
        raise JoinError(f"rank {r} is {state} (pid {pid}); join only takes "
                        f"{' or '.join(_TAKES[mode])} slots in {mode} mode")


def target_ep_size(store, default: int) -> int:
    """The deployment's current target size: the last ``POST /scale_elastic_ep``'s, else
    ``default`` (serve's ``--ep-size``)."""
    from elasticep.entrypoints.coordinator_membership import TARGET_EP_SIZE_KEY

    if store.check([TARGET_EP_SIZE_KEY]):
        text = store.get(TARGET_EP_SIZE_KEY).decode()
        if text:
            return int(text)
    return default


def run(args: argparse.Namespace) -> int:
    """Start the joiners and supervise them; returns the exit code."""
    from elasticep.entrypoints.serve_cmd import setup_logging

    setup_logging()
    try:
        mode, ranks = parse_mode_and_ranks(args)
    except JoinError as exc:
        print(f"elasticep join: error: {exc}", file=sys.stderr)
        return 2
    from elasticep.distributed import CoordinatorClient
    from elasticep.entrypoints.launcher import (
        RankDirectory,
        RankLauncher,
        fetch_config,
        kill_stale_worker,
        open_store,
    )
    from elasticep.entrypoints.supervisor import stop_on_signals, supervise

    stop = stop_on_signals()
    reservations = None
    try:
        store = open_store(args.dist_init_addr)
        config = fetch_config(store, timeout_s=10.0)
        if args.load_format is not None and args.load_format != config.load_format:
            raise JoinError(f"--load-format {args.load_format} differs from the deployment's "
                            f"{config.load_format}: every rank must hold the same weights")
        directory = RankDirectory(store)
        # claim the slots first: a second `join` of the same slot is refused here, before
        # either looks at the (not yet changed) membership
        reservations = Reservations(store)
        reservations.acquire(ranks)
        reservations.keep_alive()
        client = CoordinatorClient(args.dist_init_addr)
        try:
            snapshot = client.status()
        finally:
            client.close()
        check_slots(mode, ranks, config.max_ep_size, snapshot,
                    target_ep_size(store, config.ep_size),
                    lambda r: directory.launched_pid(r, local_node=args.node_rank))
    except JoinError as exc:
        if reservations is not None:
            reservations.release()
        print(f"elasticep join: error: {exc}", file=sys.stderr)
        return 2
    except (OSError, TimeoutError, ValueError, RuntimeError) as exc:
        if reservations is not None:
            reservations.release()
        print(f"elasticep join: error: coordinator {args.dist_init_addr}: {exc}",
              file=sys.stderr)
        return 1
    launcher = None
    try:
        if mode == "recover":
            for r in ranks:
                old_pid = snapshot.get("ranks", {}).get(str(r), {}).get("pid")
                if directory.node_of(r) == args.node_rank:
                    kill_stale_worker(old_pid, r)
        log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="elasticep-join-logs-"))
        launcher = RankLauncher(args.dist_init_addr, config, args.node_rank, directory,
                                log_dir)
        for r in ranks:
            launcher.spawn(r, mode)
        if mode == "recover":
            launcher.request_admission(ranks)
        joined = _report_progress(launcher, mode, ranks, stop)
        reservations.release()  # the ranks are in (the coordinator holds them) or gone
        if not joined:
            return 1 if not stop.is_set() else 0
        exits = supervise(launcher, stop, restart=False, until_all_exited=True)
        lost = len(joined) < len(ranks)  # some died before joining (reported already)
        return 1 if lost or any(ex.code == 1 for ex in exits) else 0
    finally:
        reservations.release()
        if launcher is not None:
            launcher.stop()


_ERROR_LINE = re.compile(r"^\w*(Error|Exception|Exit)\w*: .+")


def exit_reason(log_tail: str) -> str:
    """The one-line reason of a worker's death from the end of its log: the last
    ``SomeError: message`` line, else the last non-empty line ("" if none)."""
    lines = [ln.strip() for ln in log_tail.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if _ERROR_LINE.match(ln):
            return ln
    return lines[-1] if lines else ""


def joined_ranks(snapshot: dict, ranks: list[int], pids: dict[int, int],
                 goal: tuple[str, ...]) -> bool:
    """True if every slot of ``ranks`` reached ``goal`` held by the worker we started
    (``pids``), not by another process (pure)."""
    world = snapshot["groups"]["world"]
    states = {world["ranks"][s]: st for s, st in enumerate(world["states"])}
    procs = snapshot.get("ranks", {})
    return all(states.get(r) in goal and r in pids
               and procs.get(str(r), {}).get("pid") == pids[r] for r in ranks)


def _report_progress(launcher, mode: str, ranks: list[int], stop: threading.Event
                     ) -> list[int]:
    """Print one line when the ranks are in (recover: healthy; scale: ready to admit),
    and one error line for each rank that exits first; the others go on.

    Returns:
        The ranks that got in; empty if stopped or every rank exited first.
    """
    goal = ("healthy",) if mode == "recover" else ("ready", "healthy")
    waiting = list(ranks)
    while waiting and not stop.wait(0.2):
        while not launcher.exits.empty():
            ex = launcher.exits.get()
            if ex.rank not in waiting:
                continue
            waiting.remove(ex.rank)
            reason = exit_reason(launcher.log_tail(ex.rank, lines=40))
            log = "" if launcher.log_dir is None else f" (log {launcher.log_dir}/rank{ex.rank}.log)"
            others = f"; still joining: ranks {waiting}" if waiting else ""
            print(f"elasticep join: error: rank {ex.rank} exited with {ex.code} before it "
                  f"joined: {reason or 'no output'}{log}{others}", file=sys.stderr)
        if not waiting:
            break
        try:
            snapshot = launcher.coordinator_status()
            world = snapshot["groups"]["world"]
            done = joined_ranks(snapshot, waiting, launcher.pids(live_only=False), goal)
        except (ConnectionError, TimeoutError, OSError, KeyError) as exc:
            logger.warning("coordinator status unavailable: %s", exc)
            continue
        if done:
            if mode == "recover":
                print(f"joined: ranks {waiting} healthy at epoch {world['epoch']}", flush=True)
            else:
                print(f"ready: ranks {waiting} loaded; they are admitted once the target "
                      f"ep_size covers them (POST /scale_elastic_ep "
                      f"{{\"new_ep_size\": {max(waiting) + 1}}} if not asked yet)", flush=True)
            return waiting
    return []
