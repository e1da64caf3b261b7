"""The HTTP API of one node's ``serve``: node 0's always, every other node's under
``--membership-store etcd://`` (a front-end on every node, so that node 0 is no single
point of failure for clients).

Each front-end binds its own link (a ROUTER and a PULL, :class:`FrontendChannel`) and
announces it in etcd under a lease (:mod:`elasticep.membership.directory`);
every rank keeps a link to each announced front-end
(:mod:`elasticep.frontend_link.fanout`), so each front-end routes to every rank.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from elasticep.config import DeploymentConfig
from elasticep.deploy import Deployment
from elasticep.deploy.launcher import leader_finder
from elasticep.deploy.membership_backends import CoordinatorMembership
from elasticep.engine.limits import known_max_total_tokens
from elasticep.entrypoints.serve_args import ServeSettings
from elasticep.frontend.api_server_pool import ApiServerPool
from elasticep.frontend.api_server_proc import ApiServerSpec
from elasticep.frontend.core import Frontend
from elasticep.frontend.event_log import EventLog
from elasticep.frontend.http_server import HttpServer, create_server
from elasticep.frontend.membership_source import MembershipSource
from elasticep.frontend_link import FrontendChannel, LinkEndpoints, WorkerHello
from elasticep.membership.directory import FRONTENDS, REPLICAS, Announcement, list_entries
from elasticep.membership.election import lease_ttl_s
from elasticep.membership.errors import MembershipStoreError
from elasticep.utils.net import bind_tcp

if TYPE_CHECKING:  # etcd's client is imported only where etcd is asked for
    from elasticep.membership.etcd_store import EtcdMembershipStore

logger = logging.getLogger("elasticep.serve")

# How long open streams may still finish once serve is asked to stop (seconds).
STREAM_GRACE_S = 5.0


def bind_api(settings: ServeSettings) -> socket.socket:
    """Bind ``--host``/``--port`` before any rank starts: a taken port is refused at
    once, not after every rank has loaded, and nothing can take it meanwhile.

    Raises:
        OSError: the port cannot be bound (one line naming the flags).
    """
    try:
        return bind_tcp(settings.host, settings.port)
    except OSError as exc:
        raise OSError(f"cannot serve HTTP on {settings.host}:{settings.port} "
                      f"(--host/--port): {exc.strerror or exc}") from exc


def server_kwargs(settings: ServeSettings, dep: DeploymentConfig) -> dict[str, Any]:
    """:func:`create_server`'s keyword arguments from serve's flags (every front-end
    process of the node gets the same)."""
    return {"served_model_name": settings.served_model_name, "api_key": settings.api_key,
            "host": settings.host, "port": settings.port,
            "max_total_tokens": known_max_total_tokens(dep),
            "max_payload_size": settings.max_payload_size,
            "metrics_api_key": settings.metrics_api_key,
            "tool_call_parser": settings.tool_call_parser}


def start_api_servers(settings: ServeSettings, link_host: str, sock: socket.socket,
                      on_give_up: Callable[[str], None]) -> ApiServerPool | None:
    """The node's extra front-end processes (``--api-server-count`` - 1), started and
    with their links bound (:meth:`ApiServerPool.start`), or None for one process.
    Call it before the node's own front-end exists (its metrics go multiprocess).

    Raises:
        OSError: a process did not start.
    """
    if settings.api_server_count <= 1:
        return None
    pool = ApiServerPool(settings.api_server_count - 1, link_host, sock, STREAM_GRACE_S,
                         on_give_up=on_give_up)
    try:
        pool.start()
    except BaseException:
        pool.stop(timeout_s=1.0)
        raise
    return pool


def api_server_spec(settings: ServeSettings, dep: DeploymentConfig, address: str,
                    ranks: int = 0) -> ApiServerSpec:
    """What the node's extra front-end processes serve: serve's flags, the
    coordinator's membership at ``address`` and, under etcd, their own directory
    entries (:func:`join_directory`); each reports that it serves once ``ranks``
    ranks linked to it."""
    etcd = settings.membership_store.startswith("etcd://")
    return ApiServerSpec(
        dep.model, partial(coordinator_view, address, dep), server_kwargs(settings, dep),
        address, on_serving=partial(join_directory, settings.membership_store,
                                    settings.node_rank, dep.heartbeat_timeout_s)
        if etcd else None, ranks=ranks, gc_warning_threshold_s=dep.gc_warning_threshold_s)


def join_directory(url: str, node: int, heartbeat_timeout_s: float, index: int,
                   frontend: Frontend, endpoints: LinkEndpoints, api_url: str,
                   ) -> Callable[[], None]:
    """In extra front-end process ``index``, under etcd: announce it (``nodeK-apiI``;
    the ranks then link to it) and show the directory in its status and metrics, as
    the node's own front-end does; returns what undoes both at its stop.

    Raises:
        MembershipStoreError: etcd did not take the announcement.
    """
    reg = announce(url, node, endpoints, api_url, heartbeat_timeout_s, index)
    if reg is None:
        return lambda: None
    view = DirectoryView(reg.store, frontend)

    def leave() -> None:
        view.close()
        reg.close()
        reg.store.close()

    return leave


def coordinator_view(address: str, dep: DeploymentConfig,
                     connected: Callable[[], Mapping[int, WorkerHello]],
                     ) -> CoordinatorMembership:
    """The membership source of an extra front-end process (``--api-server-count``):
    the coordinator's view, as :meth:`Deployment.membership` gives the node's own
    front-end under the elastic backend (``connected`` is not needed there)."""
    return CoordinatorMembership(address, find_leader=leader_finder(dep, 5.0))


def open_api(settings: ServeSettings, dep: DeploymentConfig, channel: FrontendChannel,
             membership: MembershipSource, sock: socket.socket,
             ) -> tuple[HttpServer, Frontend]:
    """The HTTP server and front-end over ``channel`` (not started), with serve's flags."""
    server, frontend = create_server(dep.model, channel, membership, sock=sock,
                                     **server_kwargs(settings, dep))
    if settings.event_log is not None:
        frontend.event_log = EventLog(settings.event_log)
    return server, frontend


def api_url(settings: ServeSettings, sock: socket.socket) -> str:
    """The URL clients reach the API on, with the port ``sock`` is bound to."""
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    return f"http://{host}:{sock.getsockname()[1]}"


def frontend_name(node: int, index: int = 0) -> str:
    """A front-end's name in the directory and in ``/elastic_ep_status``: ``nodeK``,
    or ``nodeK-apiI`` for the node's extra process I (``--api-server-count``)."""
    return f"node{node}" if index == 0 else f"node{node}-api{index}"


def announce(url: str, node: int, endpoints: LinkEndpoints, api_url: str,
             heartbeat_timeout_s: float, index: int = 0) -> Announcement | None:
    """Put a front-end of this node (``index``: 0 for serve's own, I for its extra
    process I) in the etcd directory of ``url`` (``etcd://...``) under a lease of
    ``lease_ttl_s(heartbeat_timeout_s)``; returns the registration (close it at stop),
    or None for the embedded store (node 0's front-ends only, no directory).

    Raises:
        MembershipStoreError: etcd did not take the key.
    """
    if not url.startswith("etcd://"):
        return None
    from elasticep.membership.etcd_store import EtcdMembershipStore  # etcd if asked
    from elasticep.membership.store import parse_store_url

    store = EtcdMembershipStore(parse_store_url(url))
    info = {"request_addr": endpoints.request_addr, "output_addr": endpoints.output_addr,
            "url": api_url, "node": node}
    reg = Announcement(store, FRONTENDS, frontend_name(node, index), info,
                       lease_ttl_s(heartbeat_timeout_s))
    try:
        reg.start()
    except BaseException:
        store.close()
        raise
    return reg


class DirectoryView:
    """Shows the front-ends and coordinator replicas announced in etcd in
    ``/elastic_ep_status`` (``frontends``: name -> ``url`` and ``node``;
    ``coordinator_replicas``: their addresses) and ``/metrics``
    (``elasticep_frontend``, ``elasticep_coordinator_replica``), read every
    ``period_s`` seconds on a daemon thread; an unreachable etcd keeps the last view.

    Args:
        store: the deployment's etcd store (closed by :meth:`close`).
        frontend: the front-end whose status and metrics show them.
    """

    def __init__(self, store: EtcdMembershipStore, frontend: Frontend,
                 period_s: float = 1.0) -> None:
        self.store, self.frontend = store, frontend
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period_s,), daemon=True,
                                        name="directory-view")
        self._thread.start()

    def _run(self, period_s: float) -> None:
        while True:
            try:
                fronts = list_entries(self.store, FRONTENDS)
                replicas = sorted(list_entries(self.store, REPLICAS))
            except MembershipStoreError as e:
                logger.debug("directory view: %s", e)
            else:
                shown = {n: {"url": v.get("url"), "node": v.get("node")}
                         for n, v in sorted(fronts.items())}
                self.frontend.set_status_extra("frontends", shown)
                self.frontend.set_status_extra("coordinator_replicas", replicas)
                self.frontend.metrics.directory(
                    {n: str(v["url"]) for n, v in shown.items()}, replicas)
            if self._stop.wait(period_s):
                return

    def close(self) -> None:
        """Stop reading (the store is closed by its owner)."""
        self._stop.set()
        self._thread.join(timeout=5)


@dataclass
class NodeApi:
    """A node's running API: its link, server, front-end and directory entry."""

    channel: FrontendChannel
    server: HttpServer | None = None
    frontend: Frontend | None = None
    registration: Announcement | None = None  # under etcd only
    view: DirectoryView | None = None  # under etcd only
    pool: ApiServerPool | None = None  # --api-server-count > 1

    def announce(self, settings: ServeSettings, node: int, api_url: str,
                 heartbeat_timeout_s: float) -> None:
        """Under etcd: put this front-end in the directory (:func:`announce`) and,
        once the front-end exists, show the directory in its status and metrics.

        Raises:
            MembershipStoreError: etcd did not take the announcement.
        """
        self.registration = announce(settings.membership_store, node,
                                     self.channel.endpoints, api_url, heartbeat_timeout_s)
        self.show_directory()

    def show_directory(self) -> None:
        """Start the :class:`DirectoryView` if both the front-end and the
        announcement exist and it does not run yet."""
        if self.registration is not None and self.frontend is not None and self.view is None:
            self.view = DirectoryView(self.registration.store, self.frontend)

    def stop(self, reason: str, grace_s: float) -> None:
        """End the open streams (``grace_s`` to finish, then an
        error event with ``reason``), leave the directory, stop the server and close the
        link; the extra front-end processes wind down meanwhile (the same grace)."""
        if self.pool is not None:
            self.pool.signal_stop()
        if self.frontend is not None:
            self.frontend.shut_down(reason, grace_s)
        if self.view is not None:
            self.view.close()
        if self.registration is not None:  # after: the ranks abort a leaver's requests
            self.registration.close()
            self.registration.store.close()
        if self.server is not None:
            self.server.stop()
        self.channel.close()
        if self.pool is not None:
            self.pool.stop()


def start_node_api(settings: ServeSettings, deployment: Deployment, host: str,
                   on_give_up: Callable[[str], None]) -> NodeApi:
    """Nodes 1.. under etcd: bind the link on ``host`` (reachable by every node's
    ranks) and ``--port``, start the API over the deployment's membership (which follows
    the leader through etcd) and announce it in the directory; with
    ``--api-server-count`` N > 1, N-1 more front-end processes announce themselves too
    (``on_give_up``: see :class:`ApiServerPool`).

    Raises:
        OSError: ``--port`` cannot be bound, or an extra process did not start.
        MembershipStoreError: etcd did not take the announcement.
    """
    api = NodeApi(FrontendChannel(host=host))
    try:
        sock = bind_api(settings)
        api.pool = start_api_servers(settings, host, sock, on_give_up)
        membership = deployment.membership(lambda: api.channel.connected)
        api.server, api.frontend = open_api(settings, deployment.config, api.channel,
                                            membership, sock)
        api.frontend.coordinator_address = deployment.address
        api.server.start()
        api.announce(settings, settings.node_rank, api.server.url,
                     deployment.config.heartbeat_timeout_s)
        if api.pool is not None:
            api.pool.serve(api_server_spec(settings, deployment.config, deployment.address),
                           on_death=api.frontend.abort_origin)
            api.pool.wait_serving()
    except BaseException:
        api.stop("the node could not start its API", 0.0)
        raise
    return api
