"""`elasticep serve`: one command that starts a whole elastic EP deployment.

Node 0 (the default) runs the HTTP front-end (OpenAI API) in this process (and
--api-server-count - 1 more front-end processes on the same port), the
coordinator (membership, rendezvous store) in a child process of its own, and its share
of worker ranks as child processes. Nodes 1.. (--node-rank k --dist-init-addr HOST:PORT)
launch their ranks against node 0's coordinator; under --membership-store etcd://
they also serve the API. A progress bar shows ranks loading; then one
"ready" line with the URL goes to stdout. Ctrl-C / SIGTERM stops every process this
command started; workers also die with it through PR_SET_PDEATHSIG, and the coordinator
when its lifeline pipe from this process closes.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from elasticep.config import DeploymentConfig
from elasticep.deploy import Deployment
from elasticep.deploy.planned_leave import leave_on_purpose
from elasticep.deploy.restart_policy import Policy, on_exit_for, restart_budget
from elasticep.deploy.startup_error import loading_failure
from elasticep.deploy.supervisor import StopEvent, stop_on_signals, supervise
from elasticep.elastic.exchange_setup import resolve_a2a_backend
from elasticep.engine.memory_fit import deployment_fit_problem
from elasticep.entrypoints.node_api import (
    STREAM_GRACE_S,
    NodeApi,
    api_server_spec,
    api_url,
    bind_api,
    open_api,
    start_api_servers,
)
from elasticep.entrypoints.serve_args import ServeSettings, add_serve_arguments, validate
from elasticep.entrypoints.serve_node import same_layout_running, serve_node
from elasticep.entrypoints.validate import (
    LOG_DIR_HELP,
    UsageError,
    env_fault,
    env_profiler,
    make_log_dir,
    setup_logging,
)
from elasticep.frontend_link import FrontendChannel, is_routable
from elasticep.membership.errors import MembershipStoreError, PrefixInUseError
from elasticep.membership.status import DeploymentStatus
from elasticep.membership.store import parse_store_url
from elasticep.utils.gc_pauses import warn_long_collections
from elasticep.utils.startup_heap import freeze_startup_heap

logger = logging.getLogger("elasticep.serve")

EXAMPLES = """\
examples:
  elasticep serve --ep-size 4                       # the embedded demo model on 4 ranks
  elasticep serve --model /ckpt/Qwen3-30B-A3B --ep-size 4 --max-ep-size 6 \\
      --ep-num-redundant-experts 16 --restart-failed-ranks --device cuda --dtype bfloat16
  # two nodes, two ranks each (node 0 also serves the API):
  elasticep serve --ep-size 4 --nnodes 2 --node-rank 0 --dist-init-addr 10.0.0.1:29400
  elasticep serve --ep-size 4 --nnodes 2 --node-rank 1 --dist-init-addr 10.0.0.1:29400
"""

def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``serve`` subcommand."""
    p = subparsers.add_parser(
        "serve", help="serve a MoE model over an OpenAI API with elastic expert parallelism",
        description=__doc__.split("\n\n")[1], epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_arguments(p)
    p.add_argument("--log-dir", default=None,
                   help=LOG_DIR_HELP)
    return p


def run(args: argparse.Namespace) -> int:
    """Validate flags, then run node 0 or another node until stopped; returns the exit code."""
    setup_logging()
    try:
        settings = validate(args)
        problem = gpu_fit_problem(settings.deployment)
        if problem is not None:
            raise UsageError(problem)
        fault = env_fault()
        env_profiler()
        log_dir = make_log_dir(args.log_dir, "elasticep-logs-")
    except UsageError as exc:
        print(f"elasticep serve: error: {exc}", file=sys.stderr)
        return 2
    for warning in settings.warnings:
        print(f"elasticep serve: warning: {warning}", file=sys.stderr)

    deployment_id = uuid.uuid4().hex
    comes_back = False  # node 0 run again while its deployment serves on (etcd)
    try:  # before anything starts: a bad store costs nothing to find out
        check_membership_store(settings, deployment_id)
    except PrefixInUseError as exc:
        comes_back = same_layout_running(settings)
        if not comes_back:
            print(f"elasticep serve: error: --membership-store: {exc}", file=sys.stderr)
            return 2
        print("elasticep serve: node 0's deployment serves on under this --membership-store;"
              " this node 0 takes its slots back", file=sys.stderr)
        settings = replace(settings, coordinator_port=0)  # the leader, through etcd
    except MembershipStoreError as exc:
        print(f"elasticep serve: error: --membership-store: {exc}", file=sys.stderr)
        return 2
    stop = stop_on_signals()
    try:
        if settings.node_rank == 0 and not comes_back:
            return _serve_head(settings, args, stop, log_dir, fault, deployment_id)
        return serve_node(settings, stop, log_dir, fault)
    except (OSError, TimeoutError, ValueError) as exc:  # bind failures, unreachable peers
        print(f"elasticep serve: error: {exc}", file=sys.stderr)
        return 1
    except MembershipStoreError as exc:  # etcd gone while a node looked for the leader
        print(f"elasticep serve: error: --membership-store: {exc}", file=sys.stderr)
        return 2


def check_membership_store(settings: ServeSettings, deployment_id: str) -> None:
    """Node 0 with ``--membership-store etcd://``: reach etcd and claim the prefix for
    ``deployment_id`` (the coordinator process claims it again with the same id).

    Raises:
        StoreUnavailableError: no etcd member answered.
        PrefixInUseError: another deployment holds the prefix.
    """
    spec = parse_store_url(settings.membership_store)
    if spec.kind == "etcd" and settings.node_rank == 0:
        # etcd's client only where etcd is asked for: the embedded default needs none
        from elasticep.membership.etcd_store import open_etcd_store

        open_etcd_store(spec, deployment_id).close()


def gpu_fit_problem(d: DeploymentConfig) -> str | None:
    """Why this node's GPUs cannot hold the deployment's ranks, or None: the pure check
    of :func:`~elasticep.engine.limits.deployment_fit_problem` on the GPUs' sizes, read
    before any rank loads (minutes) and without a CUDA context in serve's process."""
    if d.device != "cuda":
        return None
    import torch

    from elasticep.eplb.placement import initial_slots_per_rank
    from elasticep.models.config import load_model_config

    if not torch.cuda.is_available():
        return None  # the ranks say so themselves
    mcfg = load_model_config(d.model)
    slots = initial_slots_per_rank(mcfg.num_experts, d.ep_num_redundant_experts, d.ep_size,
                                   min_ep_size=d.slot_reserve_ranks)
    total = torch.cuda.get_device_properties(0).total_memory
    return deployment_fit_problem(d, mcfg, slots, total, torch.cuda.device_count())


def _serve_head(settings: ServeSettings, args: argparse.Namespace, stop: StopEvent,
                log_dir: Path, fault: str | None, deployment_id: str) -> int:
    """Node 0: coordinator + front-end + local ranks (``fault``: their fault-injection
    spec); returns when stopped."""
    dep = settings.deployment
    where = f"{settings.coordinator_host}:{settings.coordinator_port}"
    # Workers of other nodes must reach the link sockets: bind where the coordinator is.
    api = NodeApi(FrontendChannel(host=settings.coordinator_host))
    channel = api.channel
    deployment = frontend = http_sock = None
    died: list[int] = []  # the coordinator process's exit status, if it died
    gave_up: list[str] = []  # why an extra front-end process was not relaunched

    def pool_gave_up(why: str) -> None:  # the pool's watcher thread: stop everything
        gave_up.append(why)
        stop.set()

    def coordinator_died(code: int) -> None:  # its watcher thread: stop everything
        died.append(code)
        stop.set()

    try:
        http_sock = bind_api(settings)
        # listed before any rank starts: a rank drops the links the directory lacks
        api.announce(settings, 0, api_url(settings, http_sock), dep.heartbeat_timeout_s)
        dep = replace(dep, frontend_request_addr=channel.endpoints.request_addr,
                      frontend_output_addr=channel.endpoints.output_addr)
        # their links known before any rank starts
        api.pool = start_api_servers(settings, settings.coordinator_host, http_sock,
                                     pool_gave_up)
        if api.pool is not None:
            extra = api.pool.endpoints
            dep = replace(dep, frontend_extra_request_addrs=tuple(e.request_addr for e in extra),
                          frontend_extra_output_addrs=tuple(e.output_addr for e in extra))
        if stop.is_set():  # Ctrl-C during the start: start no coordinator and no rank
            return stop.exit_status() or 1
        try:  # the local ranks first: they load while the front-end starts
            deployment = Deployment.start(
                dep, host=settings.coordinator_host, port=settings.coordinator_port,
                ranks=settings.local_ranks, log_dir=log_dir, new_session=True, fault=fault,
                on_coordinator_exit=coordinator_died,
                membership_store=settings.membership_store, deployment_id=deployment_id)
        except OSError as exc:
            raise OSError(f"cannot start the coordinator at {where} (--dist-init-addr): "
                          f"{exc.strerror or exc}") from exc
        if stop.is_set():
            return stop.exit_status() or 1
        dep = deployment.config
        logger.info("coordinator %s; %d of %d ranks on this node; worker logs in %s",
                    deployment.address, len(settings.local_ranks), dep.ep_size, log_dir)
        membership = deployment.membership(lambda: channel.connected)
        name = settings.served_model_name
        api.server, frontend = open_api(settings, dep, channel, membership, http_sock)
        api.frontend = frontend
        api.show_directory()
        server = api.server
        frontend.coordinator_address = deployment.address  # named in `join` hints
        server.start()
        if api.pool is not None:
            api.pool.serve(api_server_spec(settings, dep, deployment.address, dep.ep_size),
                           on_death=frontend.abort_origin)
        if not _wait_ready(membership, channel, deployment, dep.ep_size, stop):
            return _coordinator_died(deployment, died) or stop.exit_status() or 1
        if api.pool is not None:
            api.pool.wait_serving()
        freeze_startup_heap()  # this process's front-end: no start-up heap in GC pauses
        warn_long_collections(dep.gc_warning_threshold_s)
        print(f"ready: {server.url} (model {name}, ep_size {dep.ep_size}, max_ep_size "
              f"{dep.max_ep_size}, moe_a2a_backend {resolve_a2a_backend(dep).value}, "
              f"coordinator {deployment.address})", flush=True)
        fatal = not deployment.fault_tolerant  # backend none: any exit stops all
        policy = Policy(on_exit_for(settings.restart_failed_ranks, deployment.fault_tolerant),
                        max_restarts=settings.max_restarts,
                        restart_window_s=settings.restart_window_s,
                        rejoin_lost=dep.membership_store.startswith("etcd://"))
        exits = supervise(deployment, stop, policy,
                          on_look=lambda ledger, now: frontend.set_status_extra(
                              "restart_budget", restart_budget(policy, ledger, now)))
        if died:
            return _coordinator_died(deployment, died)
        if gave_up:
            print(f"elasticep serve: error: {gave_up[0]}; serve stops", file=sys.stderr)
            return 1
        if fatal and exits:
            ex = exits[-1]
            frontend.fail_all(f"rank {ex.rank} exited with {ex.code}; --elastic-ep-backend "
                              "none has no fault tolerance: the deployment is stopping")
            return 1
        return stop.exit_status() or 0
    finally:
        logger.info("stopping: HTTP server, workers, coordinator")
        if (deployment is not None and stop.is_set() and not died and settings.nnodes > 1
                and settings.membership_store.startswith("etcd://")):
            leave_on_purpose(deployment)  # the other nodes serve on: not a failure there
        # open streams end with an error event, not a cut; the server closes http_sock
        api.stop("the server is shutting down" + (
            " (its coordinator process died)" if died else ""), STREAM_GRACE_S)
        if api.server is None and http_sock is not None:
            http_sock.close()
        if deployment is not None:
            deployment.stop()


def coordinator_exit_message(pid: int, code: int) -> str:
    """serve's error when its coordinator process died (pure). It is not restarted: the
    membership it held (epochs, slot states, the rendezvous store) died with it, and a
    fresh one could not take the running ranks back."""
    how = f"was killed by signal {-code}" if code < 0 else f"exited with {code}"
    return (f"elasticep serve: error: the coordinator process (pid {pid}) {how}; the "
            "deployment's membership died with it, so serve stops every rank (its last "
            "log lines are above)")


def _coordinator_died(deployment: Deployment, died: list[int]) -> int:
    """If the coordinator process died: say so on stderr and return serve's status, 1;
    else 0."""
    if not died:
        return 0
    print(coordinator_exit_message(deployment.coordinator.pid, died[0]), file=sys.stderr)
    return 1


def loading_exit_message(rank: int, code: int, log_tail: str,
                         log_dir: Path | None = None) -> str:
    """serve's error when a rank exits while loading at start-up
    (:func:`~elasticep.deploy.startup_error.loading_failure`'s line; pure)."""
    return f"elasticep serve: error: {loading_failure(rank, code, log_tail, log_dir)}"


# Start-up has no deadline (a large checkpoint may load for many minutes), so a rank
# that makes no progress is named on stderr after this long instead.
STALL_NOTE_S = 60.0


def stalled_startup_message(status: DeploymentStatus, ready: set[int], ep_size: int,
                            waited_s: float, log_dir: Path | None) -> str:
    """The line serve prints when no rank became ready for ``waited_s`` seconds (pure).

    Names each launch rank not ready yet with its state and pid, and where the logs are.
    """
    waiting = []
    for r in range(ep_size):
        if r in ready:
            continue
        try:
            entry = status.rank(r)
        except KeyError:
            waiting.append(f"{r} (not registered yet)")
            continue
        pid = f", pid {entry.pid}" if entry.pid is not None else ""
        waiting.append(f"{r} ({entry.state.value}{pid})")
    where = f"; their logs are in {log_dir}" if log_dir is not None else ""
    return (f"elasticep serve: still waiting after {waited_s:.0f} s for ranks "
            f"{', '.join(waiting)}{where}")


def _wait_ready(membership, channel, deployment, ep_size: int, stop: threading.Event) -> bool:
    """Show a progress bar until ``ep_size`` ranks are routable (healthy in the coordinator
    and connected to the front-end with the same pid); every :data:`STALL_NOTE_S` without
    progress, name the ranks still waited for.

    Returns:
        True when ready; False if stopped or a local rank died while loading.
    """
    start = last_progress = time.monotonic()
    with tqdm(total=ep_size, desc="loading ranks", unit="rank", file=sys.stderr,
              mininterval=0.5, dynamic_ncols=True) as bar:
        while not stop.wait(0.1):
            if not deployment.exits.empty():
                ex = deployment.exits.get()
                bar.close()
                print(loading_exit_message(ex.rank, ex.code, deployment.log_tail(ex.rank),
                                           deployment.log_dir),
                      file=sys.stderr)
                return False
            try:
                status = membership.status()
            except (ConnectionError, TimeoutError, OSError):
                continue
            connected = channel.connected
            routable = {e.rank for e in status.ranks
                        if is_routable(e.state, e.pid, connected.get(e.rank))}
            ready = len(routable)
            if ready != bar.n:
                bar.update(ready - bar.n)
                last_progress = time.monotonic()
            elif time.monotonic() - last_progress >= STALL_NOTE_S:
                bar.write(stalled_startup_message(status, routable, ep_size,
                                                  time.monotonic() - start,
                                                  deployment.log_dir), file=sys.stderr)
                last_progress = time.monotonic()  # the next note after as long again
            if ready >= ep_size:
                time.sleep(0.1)  # let the front-end's membership watcher route to them
                return True
    return False
