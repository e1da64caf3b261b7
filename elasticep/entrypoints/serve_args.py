"""`elasticep serve` flags (named as in SGLang) and their validation.

Validation is pure apart from reading the model's ``config.json``: it turns parsed flags
into a frozen :class:`ServeSettings` or raises :class:`UsageError`, which the command
prints as one line and exits with status 2 (no traceback).
"""

from __future__ import annotations

import argparse
import ipaddress
from dataclasses import dataclass, replace
from pathlib import Path

from elasticep.config import Backend, DeploymentConfig
from elasticep.entrypoints.deployment_args import add_deployment_arguments, deployment_config
from elasticep.entrypoints.validate import (
    UsageError,
    add_coordinator_timeout_argument,
    add_gloo_ifname_argument,
    apply_gloo_ifname,
    check_address,
    check_device,
    check_model_config,
    check_model_dir,
    check_quantization,
    coordinator_timeout_check,
    port_check,
    raise_first_failure,
)
from elasticep.frontend.http_server import DEFAULT_MAX_PAYLOAD_SIZE
from elasticep.frontend.tool_parsers import TOOL_CALL_PARSERS
from elasticep.membership.store import parse_store_url


def _human_bytes(n: int) -> str:
    """``33554432`` -> ``"32 MiB"`` (the largest binary unit that divides ``n``)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} bytes"


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """Add every ``serve`` flag to ``p``."""
    groups = add_deployment_arguments(p)
    groups["fault tolerance"].add_argument(
        "--restart-failed-ranks", action="store_true",
        help="relaunch a rank of this node that crashed (never one removed by a "
             "scale-down; a rank dying while loading at start-up still stops serve)")
    groups["fault tolerance"].add_argument(
        "--max-restarts", type=int, default=5, metavar="N",
        help="with --restart-failed-ranks: relaunch a rank at most N times within "
             "--restart-window; one over it is relaunched once its oldest restart "
             "leaves the window (default: %(default)s)")
    groups["fault tolerance"].add_argument(
        "--restart-window", type=float, default=600.0, metavar="SECONDS",
        help="the window of --max-restarts (default: %(default)s)")
    h = p.add_argument_group("HTTP")
    h.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: --model exactly as given, as "
                        "in SGLang and vLLM, so clients that load the tokenizer from the "
                        "served name find it)")
    h.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_CALL_PARSERS),
                   help="the format of the model's tool calls, parsed into `tool_calls` on "
                        "/v1/chat/completions (default: the one the model family's chat "
                        "template uses: qwen3 for Qwen2/Qwen3 MoE, deepseekv3 for DeepSeek)")
    h.add_argument("--host", default="127.0.0.1",
                   help="interface of the OpenAI API, node 0's (every node's with an etcd "
                        "--membership-store) (default: %(default)s)")
    h.add_argument("--port", type=int, default=30000,
                   help="port of the OpenAI API; 0: any free one (default: %(default)s)")
    h.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    h.add_argument("--metrics-api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /metrics instead of "
                        "--api-key, so a scraper holds no API key (default: /metrics takes "
                        "--api-key, and is open without one)")
    h.add_argument("--event-log", default=None, metavar="FILE",
                   help="append every membership and recovery event (deaths, rejoins, "
                        "scales, with their phases) to FILE as JSON lines")
    h.add_argument("--max-payload-size", type=int, default=DEFAULT_MAX_PAYLOAD_SIZE,
                   metavar="BYTES",
                   help="largest request body in bytes; larger ones get 413 (default: "
                        f"{DEFAULT_MAX_PAYLOAD_SIZE} = {_human_bytes(DEFAULT_MAX_PAYLOAD_SIZE)})")
    h.add_argument("--api-server-count", type=int, default=1, metavar="N",
                   help="HTTP front-end processes on this node, sharing --port (vLLM's "
                        "flag; default 1): more of them keep up with more clients")
    n = p.add_argument_group("multi-node")
    n.add_argument("--nnodes", type=int, default=1, help="number of nodes")
    n.add_argument("--node-rank", type=int, default=0,
                   help="this node's index; node 0 runs the coordinator and the API")
    n.add_argument("--dist-init-addr", default=None,
                   help="HOST:PORT of the coordinator (node 0 binds it; others connect)")
    add_coordinator_timeout_argument(n)
    add_gloo_ifname_argument(n)
    n.add_argument("--membership-store", default="embedded",
                   metavar="embedded|etcd://HOST:PORT[,HOST:PORT...][/PREFIX]",
                   help="where the coordinator keeps the membership: embedded = in its "
                        "own process (nothing to install); etcd:// = committed to etcd "
                        "under /elasticep/PREFIX/ (default prefix elasticep), fenced by "
                        "a leader lease; etcd unreachable or the prefix held by another "
                        "deployment: exit 2 (default: %(default)s)")


@dataclass(frozen=True)
class ServeSettings:
    """Validated ``serve`` settings.

    Attributes:
        deployment: what every rank shares (front-end addresses filled in later).
        host, port, api_key, max_payload_size: the HTTP server.
        nnodes, node_rank: this node's place; ranks are split evenly over nodes.
        coordinator_host, coordinator_port: where node 0 binds the coordinator (port 0:
            any free port) and where other nodes find it (port 0 on nodes 1..: the
            leader elected in ``membership_store``).
        restart_failed_ranks: relaunch crashed local ranks.
        membership_store: the validated ``--membership-store`` value.
        coordinator_timeout_s: how long nodes 1.. try to reach the coordinator (seconds).
        max_restarts, restart_window_s: the restart budget (relaunches per rank within
            the window, seconds).
        metrics_api_key: ``/metrics``' own key; event_log: the ``--event-log`` file.
        warnings: non-fatal remarks to print.
        tool_call_parser: ``--tool-call-parser``; None: the family's.
        api_server_count: the node's front-end processes (``--api-server-count``).
        served_model_name: the ``model`` clients send: ``--served-model-name``, else
            ``--model`` exactly as given (not the resolved directory).
    """

    deployment: DeploymentConfig
    host: str
    port: int
    api_key: str | None
    max_payload_size: int
    nnodes: int
    node_rank: int
    coordinator_host: str
    coordinator_port: int
    restart_failed_ranks: bool
    coordinator_timeout_s: float = 60.0
    max_restarts: int = 5
    restart_window_s: float = 600.0
    metrics_api_key: str | None = None
    event_log: str | None = None
    warnings: tuple[str, ...] = ()
    served_model_name: str = ""
    tool_call_parser: str | None = None
    membership_store: str = "embedded"
    api_server_count: int = 1

    @property
    def local_ranks(self) -> list[int]:
        """The initial ranks this node launches (an even share of ``ep_size``)."""
        per_node = self.deployment.ep_size // self.nnodes
        return list(range(self.node_rank * per_node, (self.node_rank + 1) * per_node))


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


# Past this many front-end processes a node spends more on them than they save.
MAX_API_SERVER_COUNT = 64


def api_server_checks(args: argparse.Namespace, deployment: DeploymentConfig,
                      store_kind: str) -> list[tuple[bool, str]]:
    """``--api-server-count``'s checks, for :func:`raise_first_failure` (pure)."""
    n = args.api_server_count
    return [
        (1 <= n <= MAX_API_SERVER_COUNT,
         f"--api-server-count must be in [1, {MAX_API_SERVER_COUNT}], got {n}"),
        (n == 1 or args.node_rank == 0 or store_kind == "etcd",
         "--api-server-count > 1 applies to a node that serves the API: node 0, or "
         "any node with --membership-store etcd://"),
        (n == 1 or deployment.elastic_ep_backend == Backend.ELASTIC,
         "--api-server-count > 1 needs --elastic-ep-backend elastic (the other front-end "
         "processes follow the coordinator's membership)"),
    ]


def validate(args: argparse.Namespace) -> ServeSettings:
    """Check flags and combinations; build the settings.

    Raises:
        UsageError: with a one-line message naming the flag.
    """
    warnings: list[str] = []
    deployment = deployment_config(args, warnings)
    try:
        store = parse_store_url(args.membership_store)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    # nodes 1.. may find the coordinator as the leader elected in etcd
    finds_coordinator = store.kind == "etcd" and args.node_rank > 0
    raise_first_failure([
        port_check("--port", args.port),
        (args.max_payload_size >= 1, "--max-payload-size must be >= 1 byte"),
        (args.nnodes >= 1, "--nnodes must be >= 1"),
        coordinator_timeout_check(args),
        (args.max_restarts >= 0, "--max-restarts must be >= 0"),
        (args.event_log is None or Path(args.event_log).parent.is_dir(),
         f"--event-log {args.event_log}: its directory does not exist"),
        (args.restart_window > 0, "--restart-window must be > 0 seconds"),
        (0 <= args.node_rank < args.nnodes,
         f"--node-rank ({args.node_rank}) must be in [0, --nnodes={args.nnodes})"),
        (args.nnodes >= 1 and args.ep_size % args.nnodes == 0,  # (no modulo by 0)
         f"--ep-size ({args.ep_size}) must be a multiple of --nnodes ({args.nnodes})"),
        (args.nnodes == 1 or args.dist_init_addr or finds_coordinator,
         "--nnodes > 1 needs --dist-init-addr HOST:PORT (the coordinator on node 0; "
         "nodes 1.. may find it with --membership-store etcd://...)"),
        *api_server_checks(args, deployment, store.kind),
        (deployment.elastic_ep_backend == Backend.ELASTIC or not args.restart_failed_ranks,
         "--elastic-ep-backend none cannot take back a failed rank: drop "
         "--restart-failed-ranks"),
    ])
    check_device(args.device)
    apply_gloo_ifname(args)
    deployment = replace(deployment, model=check_model_dir(args.model, args.load_format))
    check_quantization(deployment.model, deployment.quantization)
    check_model_config(deployment.model)
    coord_host, coord_port = "127.0.0.1", 0
    if args.dist_init_addr:
        # node 0 may bind port 0 (any free port); other nodes must name the real one
        coord_host, coord_port = check_address("--dist-init-addr", args.dist_init_addr,
                                               allow_zero_port=args.node_rank == 0)
    if not _is_loopback(args.host) and not args.api_key:
        warnings.append(f"--host {args.host} exposes the API without --api-key; anyone "
                        "who can reach it may use it")
    return ServeSettings(
        deployment=deployment, host=args.host, port=args.port, api_key=args.api_key,
        max_payload_size=args.max_payload_size,
        nnodes=args.nnodes, node_rank=args.node_rank, coordinator_host=coord_host,
        coordinator_port=coord_port, restart_failed_ranks=args.restart_failed_ranks,
        coordinator_timeout_s=args.coordinator_timeout,
        max_restarts=args.max_restarts, restart_window_s=args.restart_window,
        metrics_api_key=args.metrics_api_key, event_log=args.event_log,
        warnings=tuple(warnings), membership_store=args.membership_store,
        # as given: clients send what they typed, and SGLang's bench_serving loads its
        # tokenizer from this name
        served_model_name=args.served_model_name or args.model,
        tool_call_parser=args.tool_call_parser, api_server_count=args.api_server_count)
