"""`elasticep serve` on nodes 1..: launch this node's share of ranks against node 0's
coordinator, after checking that the node's layout agrees with node 0's and that its
slots are not held; slots a dead or drained node left behind are taken back in recover
mode. Under ``--membership-store etcd://`` the node also serves the API (:mod:`.node_api`),
and node 0's ``serve`` run again after node 0 died comes back this way too
(:func:`same_layout_running`).
"""

from __future__ import annotations

import sys
from pathlib import Path

from elasticep.config import DeploymentConfig
from elasticep.deploy import Deployment
from elasticep.deploy.coordinator_replica import CoordinatorReplica, local_address_towards
from elasticep.deploy.planned_leave import leave_on_purpose
from elasticep.deploy.probe import coordinator_lost, reach_coordinator
from elasticep.deploy.restart_policy import Policy, Until, on_exit_for, recover_command
from elasticep.deploy.supervisor import (
    CoordinatorUnreachableError,
    StopEvent,
    exit_status,
    supervise,
)
from elasticep.elastic.exit_code import ExitCode
from elasticep.entrypoints.node_api import STREAM_GRACE_S, start_node_api
from elasticep.entrypoints.serve_args import ServeSettings
from elasticep.membership.client import CoordinatorClient
from elasticep.membership.errors import JoinRefusedError
from elasticep.membership.status import DeploymentStatus
from elasticep.membership.transitions import SlotState
from elasticep.utils.gc_pauses import warn_long_collections
from elasticep.utils.startup_heap import freeze_startup_heap


def ranks_in_use(status: DeploymentStatus, ranks: list[int], address: str,
                 node: int) -> str | None:
    """Why this node cannot start ``ranks``, or None (pure).

    A slot a live process holds (a member, or a joiner loading) is in use: started
    again, a rank would be refused by the coordinator and die with a traceback, after
    loading. Failed and free slots are not: a node's ``serve`` run again after the node
    died (or was drained) takes them back in place (:func:`rejoin_ranks`).

    Returns:
        One line naming the slots in use, their states and pids.
    """
    held = [status.rank(r) for r in ranks if status.rank(r).pid is not None
            and status.rank(r).state not in (SlotState.FAILED, SlotState.FREE)]
    if not held:
        return None
    names = ", ".join(f"rank {r.rank} is {r.state.value} (pid {r.pid})" for r in held)
    return (f"{names} in the running deployment at {address}; a node's serve run again "
            "takes back only failed or retired slots (stop the process holding them first)")


def rejoin_ranks(status: DeploymentStatus, ranks: list[int]) -> list[int]:
    """The slots of ``ranks`` this node takes back in recover mode rather than start as
    the launch cohort (pure): the failed ones (the node died) and the free ones (the
    node was drained). An orchestrator restarting a node's pod runs the same ``serve``
    again, and this makes that work as `join ... --elastic-ep-join-mode recover` would.
    """
    return [r for r in ranks if status.rank(r).state in (SlotState.FAILED, SlotState.FREE)]


def _claim_for_recovery(address: str, ranks: list[int]) -> str | None:
    """Check with the coordinator that ``ranks`` may be taken back in recover mode (a
    retired slot comes back into the target); returns why not, or None. The launch
    records of the relaunch then keep a second `join` off them."""
    client = CoordinatorClient(address)
    try:
        client.reserve(ranks, "recover")
    except JoinRefusedError as exc:
        return str(exc)
    finally:
        client.close()
    return None


def layout_mismatch(mine: DeploymentConfig, node0: DeploymentConfig, address: str,
                    ) -> str | None:
    """Why this node's ``--nnodes`` / ``--ep-size`` cannot join node 0's launch, or None
    (pure). A node with another split would launch ranks node 0 does not wait for (or
    none of the ones it does), and node 0 would fail a minute later for an unrelated
    reason ("inner group not built in time").

    Returns:
        One line naming both values of the first flag that differs.
    """
    for flag, field in (("--nnodes", "nnodes"), ("--ep-size", "ep_size")):
        ours, theirs = getattr(mine, field), getattr(node0, field)
        if ours != theirs:
            return (f"{flag} {ours} disagrees with node 0's {flag} {theirs} (the deployment "
                    f"at {address}); start every node with the same {flag}")
    return None


def same_layout_running(settings: ServeSettings) -> bool:
    """Whether the deployment whose coordinator holds ``--membership-store``'s prefix
    published the same ``--nnodes`` and ``--ep-size`` as these flags: node 0's ``serve``
    run again after node 0 died then takes its slots back as another node's would
    (:func:`serve_node`; a live node 0's slots are still refused there). A prefix held
    by another deployment, or by one that published nothing yet, stays refused.

    Raises:
        StoreUnavailableError: etcd did not answer.
    """
    from elasticep.membership.etcd_store import EtcdMembershipStore  # etcd if asked
    from elasticep.membership.store import parse_store_url

    store = EtcdMembershipStore(parse_store_url(settings.membership_store))
    try:
        state, _ = store.load()
    finally:
        store.close()
    if state is None or state.config is None:
        return False
    published = DeploymentConfig.from_json(state.config)
    return layout_mismatch(settings.deployment, published, "") is None


def serve_node(settings: ServeSettings, stop: StopEvent, log_dir: Path,
                fault: str | None) -> int:
    """Nodes 1..: launch this node's share of ranks against node 0's coordinator
    (``fault``: their fault-injection spec)."""
    address = f"{settings.coordinator_host}:{settings.coordinator_port}"
    if settings.coordinator_port == 0:  # no --dist-init-addr: the leader in etcd
        from elasticep.membership.etcd_store import find_coordinator

        address = find_coordinator(settings.membership_store, settings.coordinator_timeout_s)
    if not reach_coordinator(address, settings.coordinator_timeout_s, stop=stop):
        return stop.exit_status() or 1
    deployment = Deployment.attach(address, node=settings.node_rank, log_dir=log_dir,
                                   new_session=True)
    dep = deployment.config
    if dep.membership_store.startswith("etcd://"):  # a standby coordinator on each node
        deployment.replica = CoordinatorReplica.standby(
            local_address_towards(address), dep.membership_store,
            hb_timeout_s=dep.heartbeat_timeout_s)
    per_node = dep.ep_size // settings.nnodes
    ranks = list(range(settings.node_rank * per_node, (settings.node_rank + 1) * per_node))
    api = None
    try:
        mismatch = layout_mismatch(settings.deployment, dep, address)
        if mismatch:
            print(f"elasticep serve: error: node {settings.node_rank}: {mismatch}",
                  file=sys.stderr)
            return 2
        status = deployment.deployment_status()
        taken = ranks_in_use(status, ranks, address, settings.node_rank)
        if taken:
            print(f"elasticep serve: error: node {settings.node_rank}: {taken}", file=sys.stderr)
            return 2
        if deployment.replica is not None:  # etcd: this node serves the API too
            api = start_node_api(settings, deployment, deployment.replica.host,
                                 on_give_up=lambda _: stop.set())  # the pool said why
        rejoin = rejoin_ranks(status, ranks)
        if rejoin:
            refused = _claim_for_recovery(address, rejoin)
            if refused:
                print(f"elasticep serve: error: node {settings.node_rank}: {refused}",
                      file=sys.stderr)
                return 2
            deployment.relaunch(*rejoin)  # recover mode, admitted at a step boundary
        fresh = [r for r in ranks if r not in rejoin]
        if fresh:
            deployment.launch(fresh, fault=fault)
        what = (f"launched ranks {fresh}" if not rejoin else
                f"rejoins ranks {rejoin} in place (recover mode)"
                + (f" and launched ranks {fresh}" if fresh else ""))
        serving = f"; API at {api.server.url}" if api is not None and api.server else ""
        freeze_startup_heap()  # a node's front-end and supervisor: no start-up heap in GC
        warn_long_collections(dep.gc_warning_threshold_s)
        print(f"ready: node {settings.node_rank} {what} for coordinator {address}{serving}",
              flush=True)
        fatal = not deployment.fault_tolerant
        try:
            exits = supervise(deployment, stop, Policy(
                on_exit_for(settings.restart_failed_ranks, deployment.fault_tolerant),
                Until.ALL_EXITED, max_restarts=settings.max_restarts,
                restart_window_s=settings.restart_window_s,
                coordinator_timeout_s=settings.coordinator_timeout_s,
                rejoin_lost=dep.membership_store.startswith("etcd://")))
        except CoordinatorUnreachableError as exc:  # --restart-failed-ranks waited in vain
            print(f"elasticep serve: error: node {settings.node_rank}: lost the coordinator: "
                  f"{exc}; the ranks of this node stopped", file=sys.stderr)
            return 1
        if fatal and exits:
            return 1
        # ranks left alive at a stop are no loss; without a stop, every rank exited:
        # if the coordinator is gone, or was for a while, that is why (a rank may see its
        # peers die first and exit with an error, not with the lost-coordinator 3)
        if not stop.is_set() and any(ex.code != ExitCode.REMOVED for ex in exits):
            lost = sorted({ex.rank for ex in exits if ex.code != ExitCode.REMOVED})
            hint = (f"relaunch them with `{recover_command(address, lost, settings.node_rank)}`"
                    ", or run this node with --restart-failed-ranks")
            reason = coordinator_lost(address, settings.coordinator_timeout_s, stop, hint)
            if reason:
                print(f"elasticep serve: error: node {settings.node_rank}: {reason}",
                      file=sys.stderr)
                return 1
        return stop.exit_status() or exit_status(len(ranks), len(ranks), exits, stop)
    finally:
        if stop.is_set() and deployment.replica is not None:
            leave_on_purpose(deployment)  # the other nodes serve on: not a failure there
        if api is not None:
            api.stop("the server is shutting down", STREAM_GRACE_S)
        deployment.stop()
