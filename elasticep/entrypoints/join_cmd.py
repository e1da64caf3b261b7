"""`elasticep join`: start ranks that join a running deployment, and watch them.

Two modes (flags named as in SGLang):

* recover (alias --elastic-ep-rejoin): relaunch failed slots. An evicted worker of that
  slot that is still alive on this machine (frozen) is killed first. The new rank loads
  (the slot still shows failed), registers (joining), reports ready, and is admitted at a
  step boundary (healthy).
* scale: start ranks in free capacity (serve --max-ep-size); they wait in "ready" until
  POST /scale_elastic_ep {"new_ep_size": K} admits them.

Everything else (model, dtype, device, EP settings, front-end addresses) comes from the
coordinator. The command stays in the foreground and reports its ranks. Ctrl-C (or
SIGTERM) hands the ranks that are already members over to the deployment: they keep
serving, the coordinator tracks them by pid, and `serve --restart-failed-ranks` on the
same node relaunches them if they fail. Ranks not admitted yet stop. --detach returns
once the ranks are members; --stop-ranks-on-exit makes Ctrl-C stop every rank it started.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import threading

from elasticep.config import JoinMode
from elasticep.deploy import Deployment, fetch_config
from elasticep.deploy.probe import NotACoordinatorError, coordinator_lost, reach_coordinator
from elasticep.deploy.restart_policy import OnExit, Policy, Until
from elasticep.deploy.supervisor import exit_status, stop_on_signals, supervise
from elasticep.elastic.exit_code import ExitCode
from elasticep.entrypoints.validate import (
    LOG_DIR_HELP,
    UsageError,
    add_coordinator_timeout_argument,
    add_gloo_ifname_argument,
    add_load_format_argument,
    apply_gloo_ifname,
    check_address,
    coordinator_timeout_check,
    env_profiler,
    make_log_dir,
    raise_first_failure,
    setup_logging,
)
from elasticep.membership import CoordinatorClient
from elasticep.membership.errors import JoinRefusedError, MembershipStoreError
from elasticep.membership.status import DeploymentStatus
from elasticep.membership.store import parse_store_url
from elasticep.membership.transitions import SlotState

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

class JoinError(ValueError):
    """The join cannot proceed (bad flags or an occupied slot); exit status 2."""

def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``join`` subcommand."""
    p = subparsers.add_parser(
        "join", help="add ranks to a running deployment (rejoin a failed rank, or scale up)",
        description=__doc__.split("\n\n", 1)[1], epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dist-init-addr", default=None,
                   help="HOST:PORT of the deployment's coordinator (printed by serve); "
                        "not needed with --membership-store etcd://")
    p.add_argument("--membership-store", default=None,
                   metavar="etcd://HOST:PORT[,HOST:PORT...][/PREFIX]",
                   help="find the coordinator as the leader elected in etcd (serve's "
                        "--membership-store) instead of --dist-init-addr")
    p.add_argument("--elastic-ep-join-mode", choices=[m.value for m in JoinMode], default=None,
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
                   help=LOG_DIR_HELP)
    on_exit = p.add_mutually_exclusive_group()
    on_exit.add_argument("--detach", action="store_true",
                         help="return once the ranks are members (healthy), leaving them "
                              "running in the deployment (scale: after the POST that admits "
                              "them)")
    on_exit.add_argument("--stop-ranks-on-exit", action="store_true",
                         help="Ctrl-C / SIGTERM stop every rank this join started (default: "
                              "members keep serving, only ranks not admitted yet stop)")
    add_coordinator_timeout_argument(p)
    add_gloo_ifname_argument(p)
    add_load_format_argument(p, default=None,
                             help_suffix=" (default: the deployment's; a different one is "
                                         "refused)")
    return p


def parse_mode_and_ranks(args: argparse.Namespace) -> tuple[JoinMode, list[int]]:
    """The join mode and the slots, from the flags (no I/O).

    Raises:
        JoinError: missing or contradictory flags.
    """
    mode = None if args.elastic_ep_join_mode is None else JoinMode(args.elastic_ep_join_mode)
    if args.elastic_ep_rejoin:
        if mode == JoinMode.SCALE:
            raise JoinError("--elastic-ep-rejoin means recover mode; it contradicts "
                            "--elastic-ep-join-mode scale")
        mode = JoinMode.RECOVER
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


def run(args: argparse.Namespace) -> int:
    """Start the joiners and supervise them; returns the exit code."""
    setup_logging()
    try:
        mode, ranks = parse_mode_and_ranks(args)
        raise_first_failure([coordinator_timeout_check(args)])
        try:
            store = parse_store_url(args.membership_store)
        except ValueError as exc:
            raise JoinError(str(exc)) from None
        if args.dist_init_addr is None and store.kind != "etcd":
            raise JoinError("give --dist-init-addr HOST:PORT (printed by serve) or "
                            "--membership-store etcd://...")
        if args.dist_init_addr is None:
            from elasticep.membership.etcd_store import find_coordinator

            args.dist_init_addr = find_coordinator(args.membership_store,
                                                   args.coordinator_timeout)
        check_address("--dist-init-addr", args.dist_init_addr)
        apply_gloo_ifname(args)
        env_profiler()
        log_dir = make_log_dir(args.log_dir, "elasticep-join-logs-")
    except (JoinError, UsageError) as exc:
        print(f"elasticep join: error: {exc}", file=sys.stderr)
        return 2
    except MembershipStoreError as exc:
        print(f"elasticep join: error: --membership-store: {exc}", file=sys.stderr)
        return 2
    except TimeoutError as exc:  # no coordinator leads in etcd
        print(f"elasticep join: error: --membership-store: {exc}", file=sys.stderr)
        return 1

    stop = stop_on_signals()
    client = None
    try:
        if not reach_coordinator(args.dist_init_addr, args.coordinator_timeout, stop=stop):
            return stop.exit_status() or 1
        config = fetch_config(args.dist_init_addr, timeout_s=args.coordinator_timeout)
        if args.load_format is not None and args.load_format != config.load_format:
            raise JoinError(f"--load-format {args.load_format} differs from the deployment's "
                            f"{config.load_format}: every rank must hold the same weights")
        # The coordinator checks the slots and claims them for this connection in one
        # step: a second `join` of the same slot is refused, and the claim goes with
        # this process if it dies.
        client = CoordinatorClient(args.dist_init_addr)
        client.reserve(ranks, mode)
        deployment = Deployment(args.dist_init_addr, config, node=args.node_rank,
                                log_dir=log_dir, new_session=True,
                                outlive=not args.stop_ranks_on_exit)
    except (JoinError, JoinRefusedError) as exc:
        if client is not None:
            client.close()
        print(f"elasticep join: error: {exc}", file=sys.stderr)
        return 2
    except (NotACoordinatorError, TimeoutError) as exc:  # they name the address
        print(f"elasticep join: error: {exc}", file=sys.stderr)
        return 1
    except (OSError, ValueError, RuntimeError) as exc:
        if client is not None:
            client.close()
        print(f"elasticep join: error: coordinator {args.dist_init_addr}: {exc}",
              file=sys.stderr)
        return 1
    detached = False
    try:
        if mode == JoinMode.RECOVER:
            deployment.relaunch(*ranks)  # a frozen old worker on this node is killed first
        else:
            deployment.launch(ranks, mode)
        joined = _report_progress(deployment, mode, ranks, stop, members=args.detach)
        client.close()  # releases the claims: the ranks are in (the coordinator holds them)
        if not joined:
            return stop.exit_status() or 1
        if args.detach:
            detached = True  # the finally below hands the members over
            return 0 if len(joined) == len(ranks) else 1
        exits = supervise(deployment, stop, Policy(OnExit.LOG, Until.ALL_EXITED),
                          on_look=AdmissionReport(joined if mode == JoinMode.SCALE else []))
        if not stop.is_set() and any(ex.code != ExitCode.REMOVED for ex in exits):
            reason = coordinator_lost(args.dist_init_addr, args.coordinator_timeout, stop)
            if reason:
                print(f"elasticep join: error: {reason}", file=sys.stderr)
                return 1
        # a rank that died before joining was reported already; one lost later too
        return exit_status(len(ranks), len(joined), exits, stop)
    finally:
        client.close()
        if detached or (stop.is_set() and not args.stop_ranks_on_exit):
            _hand_over(deployment)
        else:
            deployment.stop()


def _hand_over(deployment: Deployment) -> None:
    """Leave the members among our ranks running in the deployment; say so in one line."""
    kept = deployment.hand_over()
    if kept:
        print(f"elasticep join: ranks {sorted(kept)} (pids {[kept[r] for r in sorted(kept)]}) "
              f"keep serving in the deployment; the coordinator tracks them. If they fail, "
              f"`elasticep join --elastic-ep-join-mode recover` relaunches them, and so "
              f"does the serve of node {deployment.node} if it runs with "
              f"--restart-failed-ranks", file=sys.stderr, flush=True)


_ERROR_LINE = re.compile(r"^\w*(Error|Exception|Exit)\w*: .+")


def exit_reason(log_tail: str) -> str:
    """The one-line reason of a worker's death from the end of its log: the last
    ``SomeError: message`` line, else the last non-empty line ("" if none)."""
    lines = [ln.strip() for ln in log_tail.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if _ERROR_LINE.match(ln):
            return ln
    return lines[-1] if lines else ""


def joined_ranks(status: DeploymentStatus, ranks: list[int], pids: dict[int, int],
                 goal: tuple[SlotState, ...]) -> bool:
    """True if every slot of ``ranks`` reached ``goal`` held by the worker we started
    (``pids``), not by another process (pure)."""
    have = status.pids()
    return all(status.state_of(r) in goal and r in pids and have.get(r) == pids[r]
               for r in ranks)


def _others(waiting: list[int], arrived: list[int], status: DeploymentStatus | None) -> str:
    """The tail of an exit line: which of the other ranks got in (with their state) and
    which are still joining (pure)."""
    inside = [r for r in waiting if r in arrived]
    joining = [r for r in waiting if r not in arrived]
    parts = [f"rank {r} is {status.state_of(r).value}" for r in inside] if status else []
    if joining:
        parts.append(f"still joining: ranks {joining}")
    return "".join(f"; {p}" for p in parts)


class AdmissionReport:
    """Prints one ``admitted:`` line when ranks that were only loaded (scale mode: ready,
    waiting for the target to cover them) become members; a supervisor callback.

    Args:
        ranks: the ranks still to report.
    """

    def __init__(self, ranks: list[int]) -> None:
        self.pending = set(ranks)

    def __call__(self, ledger, now: float) -> None:
        admitted = sorted(r for r in self.pending if r in ledger.admitted)
        if admitted:
            self.pending -= set(admitted)
            print(f"admitted: ranks {admitted} are members (healthy)", flush=True)


def _report_progress(deployment, mode: JoinMode, ranks: list[int], stop: threading.Event,
                     members: bool = False) -> list[int]:
    """Print one line when the ranks are in (recover, or ``members``: healthy; scale:
    ready to admit), and one error line for each rank that exits first; the others go on.

    Returns:
        The ranks that got in; empty if stopped or every rank exited first.
    """
    members = members or mode == JoinMode.RECOVER
    goal = (SlotState.HEALTHY,) if members else (SlotState.READY, SlotState.HEALTHY)
    waiting = list(ranks)
    while waiting and not stop.wait(0.2):
        # the status first: an exit line must not call a rank that got in "still joining"
        try:
            status = deployment.deployment_status()
            pids = deployment.pids(live_only=False)
            arrived = [r for r in waiting if joined_ranks(status, [r], pids, goal)]
        except (ConnectionError, TimeoutError, OSError, ValueError) as exc:
            logger.warning("coordinator status unavailable: %s", exc)
            status, arrived = None, []
        while not deployment.exits.empty():
            ex = deployment.exits.get()
            if ex.rank not in waiting:
                continue
            waiting.remove(ex.rank)
            reason = exit_reason(deployment.log_tail(ex.rank, lines=40))
            log = ("" if deployment.log_dir is None
                   else f" (log {deployment.log_dir}/rank{ex.rank}.log)")
            print(f"elasticep join: error: rank {ex.rank} exited with {ex.code} before it "
                  f"joined: {reason or 'no output'}{log}{_others(waiting, arrived, status)}",
                  file=sys.stderr)
        if not waiting:
            break
        if status is None:
            continue
        if set(waiting) <= set(arrived):
            if members:
                print(f"joined: ranks {waiting} healthy at epoch {status.epoch}", flush=True)
            else:
                print(f"ready: ranks {waiting} loaded; they are admitted once the target "
                      f"ep_size covers them (POST /scale_elastic_ep "
                      f"{{\"new_ep_size\": {max(waiting) + 1}}} if not asked yet)", flush=True)
            return waiting
    return []
