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
import sys
import tempfile
import threading
from pathlib import Path

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


class JoinError(ValueError):
    """The join cannot proceed (bad flags or an occupied slot); exit status 2."""


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


def check_slots(mode: str, ranks: list[int], max_ep_size: int, snapshot: dict) -> None:
    """Refuse slots outside the capacity or not free for ``mode`` (pure).

    Args:
        snapshot: ``CoordinatorClient.status()``.

    Raises:
        JoinError: with the slot, its state and pid.
    """
    world = snapshot.get("groups", {}).get("world")
    if world is None:
        raise JoinError("the deployment has no ranks yet; wait for serve's ready line")
    for r in ranks:
        if not 0 <= r < max_ep_size:
            raise JoinError(f"rank {r} is outside the capacity [0, {max_ep_size}) "
                            f"(serve --max-ep-size)")
        state = world["states"][world["ranks"].index(r)]
        if state in _TAKES[mode]:
            continue
        pid = snapshot.get("ranks", {}).get(str(r), {}).get("pid")
        if state == "removed":
            raise JoinError(f"rank {r} is free capacity (or was removed by a scale-down); "
                            "use --elastic-ep-join-mode scale and POST /scale_elastic_ep")
        if state == "failed":
            raise JoinError(f"rank {r} has failed; relaunch it with "
                            "--elastic-ep-join-mode recover")
        raise JoinError(f"rank {r} is {state} (pid {pid}); join only takes "
                        f"{' or '.join(_TAKES[mode])} slots in {mode} mode")


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
    try:
        store = open_store(args.dist_init_addr)
        config = fetch_config(store, timeout_s=10.0)
        client = CoordinatorClient(args.dist_init_addr)
        try:
            snapshot = client.status()
        finally:
            client.close()
        check_slots(mode, ranks, config.max_ep_size, snapshot)
    except JoinError as exc:
        print(f"elasticep join: error: {exc}", file=sys.stderr)
        return 2
    except (OSError, TimeoutError, ValueError) as exc:
        print(f"elasticep join: error: coordinator {args.dist_init_addr}: {exc}",
              file=sys.stderr)
        return 1
    directory = RankDirectory(store)
    if mode == "recover":
        for r in ranks:
            old_pid = snapshot.get("ranks", {}).get(str(r), {}).get("pid")
            if directory.node_of(r) == args.node_rank:
                kill_stale_worker(old_pid, r)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="elasticep-join-logs-"))
    launcher = RankLauncher(args.dist_init_addr, config, args.node_rank, directory, log_dir)
    try:
        for r in ranks:
            launcher.spawn(r, mode)
        if mode == "recover":
            launcher.request_admission(ranks)
        if not _report_progress(launcher, mode, ranks, stop):
            return 1 if not stop.is_set() else 0
        exits = supervise(launcher, stop, restart=False, until_all_exited=True)
        return 1 if any(ex.code == 1 for ex in exits) else 0
    finally:
        launcher.stop()


def _report_progress(launcher, mode: str, ranks: list[int], stop: threading.Event) -> bool:
    """Print one line when the ranks are in (recover: healthy; scale: ready to admit).

    Returns:
        False if stopped or a rank exited first.
    """
    goal = ("healthy",) if mode == "recover" else ("ready", "healthy")
    while not stop.wait(0.2):
        if not launcher.exits.empty():
            ex = launcher.exits.get()
            print(f"elasticep join: error: rank {ex.rank} exited with {ex.code} before it "
                  f"joined; its log ends with:\n{launcher.log_tail(ex.rank)}", file=sys.stderr)
            return False
        try:
            world = launcher.coordinator_status()["groups"]["world"]
        except (ConnectionError, TimeoutError, OSError, KeyError) as exc:
            logger.warning("coordinator status unavailable: %s", exc)
            continue
        states = {world["ranks"][s]: st for s, st in enumerate(world["states"])}
        if all(states.get(r) in goal for r in ranks):
            if mode == "recover":
                print(f"joined: ranks {ranks} healthy at epoch {world['epoch']}", flush=True)
            else:
                print(f"ready: ranks {ranks} loaded; admit them with POST /scale_elastic_ep "
                      f"{{\"new_ep_size\": {max(ranks) + 1}}}", flush=True)
            return True
    return False
