"""`elasticep serve` flags (named as in SGLang) and their validation.

Validation is pure apart from reading the model's ``config.json``: it turns parsed flags
into a frozen :class:`ServeSettings` or raises :class:`UsageError`, which the command
prints as one line and exits with status 2 (no traceback).
"""

from __future__ import annotations

import argparse
import ipaddress
import math
from dataclasses import dataclass

from elasticep.elastic.config import DeploymentConfig
from elasticep.entrypoints.generate_cmd import default_model_dir
from elasticep.entrypoints.validate import (
    add_coordinator_timeout_argument,
    add_cuda_graph_argument,
    add_gloo_ifname_argument,
    add_load_format_argument,
    apply_gloo_ifname,
    check_address,
    check_device,
    check_model_dir,
    coordinator_timeout_check,
    ep_flag_checks,
    port_check,
    raise_first_failure,
    resolved_max_ep_size,
    static_backend_check,
)
from elasticep.frontend.http_server import DEFAULT_MAX_PAYLOAD_SIZE
from elasticep.models.config import SUPPORTED_FAMILIES

DTYPES = ("float32", "bfloat16")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """Add every ``serve`` flag to ``p``."""
    m = p.add_argument_group("model")
    m.add_argument("--model", "--model-path", dest="model", default=str(default_model_dir()),
                   help=f"HF checkpoint directory ({', '.join(SUPPORTED_FAMILIES)}); "
                        "default: the embedded demo model")
    m.add_argument("--dtype", choices=DTYPES, default="float32", help="weight/activation dtype")
    add_load_format_argument(m)
    add_cuda_graph_argument(m)
    m.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where weights and compute live (cuda: one GPU per rank; the "
                        "expert exchange runs over NCCL, control traffic over Gloo)")
    m.add_argument("--max-total-tokens", type=int, default=8192,
                   help="KV-cache capacity per rank, in tokens (default: %(default)s)")
    e = p.add_argument_group("expert parallelism")
    e.add_argument("--ep-size", type=int, default=1,
                   help="number of ranks to start (default: %(default)s)")
    e.add_argument("--max-ep-size", type=int, default=None,
                   help="capacity reserved for scale-up (default: --ep-size)")
    e.add_argument("--ep-num-redundant-experts", type=int, default=0,
                   help="extra physical expert slots (replicas) over all ranks")
    e.add_argument("--ep-dispatch-algorithm", choices=("static", "dynamic"), default="static",
                   help="replica choice: static = nearest, dynamic = spread")
    e.add_argument("--enable-eplb", action="store_true",
                   help="rebalance experts from measured load")
    e.add_argument("--eplb-rebalance-num-iterations", type=int, default=1000,
                   help="steps between EPLB rebalances")
    e.add_argument("--elastic-ep-backend", choices=("elastic", "none"), default="elastic",
                   help="elastic: survive rank failures; none: plain torch.distributed groups "
                        "(Gloo on CPU, NCCL for CUDA tensors), no fault tolerance (a rank "
                        "failure stops the deployment)")
    f = p.add_argument_group("fault tolerance")
    f.add_argument("--restart-failed-ranks", action="store_true",
                   help="relaunch a rank of this node that crashed (never one removed "
                        "by a scale-down; a rank dying while loading at start-up still "
                        "stops serve)")
    f.add_argument("--log-stats-interval", type=float, default=10.0,
                   help="seconds between each rank's throughput log line (steps, generated "
                        "tokens/s, CUDA graph replays); 0 turns it off (default: "
                        "%(default)s)")
    f.add_argument("--heartbeat-timeout", type=float, default=2.0,
                   help="seconds without heartbeat before a frozen rank is evicted "
                        "(default: %(default)s)")
    h = p.add_argument_group("HTTP")
    h.add_argument("--host", default="127.0.0.1",
                   help="interface of the OpenAI API (default: %(default)s)")
    h.add_argument("--port", type=int, default=30000,
                   help="port of the OpenAI API; 0: any free one (default: %(default)s)")
    h.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    h.add_argument("--max-payload-size", type=int, default=DEFAULT_MAX_PAYLOAD_SIZE,
                   help="largest request body in bytes; larger ones get 413 (default: "
                        "%(default)s)")
    n = p.add_argument_group("multi-node")
    n.add_argument("--nnodes", type=int, default=1, help="number of nodes")
    n.add_argument("--node-rank", type=int, default=0,
                   help="this node's index; node 0 runs the coordinator and the API")
    n.add_argument("--dist-init-addr", default=None,
                   help="HOST:PORT of the coordinator (node 0 binds it; others connect)")
    add_coordinator_timeout_argument(n)
    add_gloo_ifname_argument(n)


@dataclass(frozen=True)
class ServeSettings:
    """Validated ``serve`` settings.

    Attributes:
        deployment: what every rank shares (front-end addresses filled in later).
        host, port, api_key, max_payload_size: the HTTP server.
        nnodes, node_rank: this node's place; ranks are split evenly over nodes.
        coordinator_host, coordinator_port: where node 0 binds the coordinator (port 0:
            any free port) and where other nodes find it.
        restart_failed_ranks: relaunch crashed local ranks.
        coordinator_timeout_s: how long nodes 1.. try to reach the coordinator (seconds).
        warnings: non-fatal remarks to print.
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
    warnings: tuple[str, ...] = ()

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


def validate(args: argparse.Namespace) -> ServeSettings:
    """Check flags and combinations; build the settings.

    Raises:
        UsageError: with a one-line message naming the flag.
    """
    max_ep = resolved_max_ep_size(args)
    raise_first_failure([
        *ep_flag_checks(args, max_ep),
        (0 < args.heartbeat_timeout < math.inf,
         "--heartbeat-timeout must be a finite number of seconds > 0"),
        (0 <= args.log_stats_interval < math.inf,
         "--log-stats-interval must be a finite number of seconds >= 0 (0: off)"),
        port_check("--port", args.port),
        (args.max_payload_size >= 1, "--max-payload-size must be >= 1 byte"),
        (args.nnodes >= 1, "--nnodes must be >= 1"),
        coordinator_timeout_check(args),
        (0 <= args.node_rank < args.nnodes,
         f"--node-rank ({args.node_rank}) must be in [0, --nnodes={args.nnodes})"),
        (args.nnodes >= 1 and args.ep_size % args.nnodes == 0,  # (no modulo by 0)
         f"--ep-size ({args.ep_size}) must be a multiple of --nnodes ({args.nnodes})"),
        (args.nnodes == 1 or args.dist_init_addr,
         "--nnodes > 1 needs --dist-init-addr HOST:PORT (the coordinator on node 0)"),
        static_backend_check(args, max_ep),
        (args.elastic_ep_backend == "elastic" or not args.restart_failed_ranks,
         "--elastic-ep-backend none cannot take back a failed rank: drop "
         "--restart-failed-ranks"),
    ])
    check_device(args.device)
    apply_gloo_ifname(args)
    model = check_model_dir(args.model)
    coord_host, coord_port = "127.0.0.1", 0
    if args.dist_init_addr:
        # node 0 may bind port 0 (any free port); other nodes must name the real one
        coord_host, coord_port = check_address("--dist-init-addr", args.dist_init_addr,
                                               allow_zero_port=args.node_rank == 0)
    warnings = []
    if not _is_loopback(args.host) and not args.api_key:
        warnings.append(f"--host {args.host} exposes the API without --api-key; anyone "
                        "who can reach it may use it")
    deployment = DeploymentConfig(
        model=model, dtype=args.dtype, device=args.device, ep_size=args.ep_size,
        max_ep_size=max_ep, ep_num_redundant_experts=args.ep_num_redundant_experts,
        ep_dispatch_algorithm=args.ep_dispatch_algorithm, enable_eplb=args.enable_eplb,
        eplb_rebalance_num_iterations=args.eplb_rebalance_num_iterations,
        elastic_ep_backend=args.elastic_ep_backend, max_total_tokens=args.max_total_tokens,
        heartbeat_timeout_s=args.heartbeat_timeout, load_format=args.load_format,
        disable_cuda_graph=args.disable_cuda_graph,
        log_stats_interval_s=args.log_stats_interval, nnodes=args.nnodes)
    return ServeSettings(
        deployment=deployment, host=args.host, port=args.port, api_key=args.api_key,
        max_payload_size=args.max_payload_size,
        nnodes=args.nnodes, node_rank=args.node_rank, coordinator_host=coord_host,
        coordinator_port=coord_port, restart_failed_ranks=args.restart_failed_ranks,
        coordinator_timeout_s=args.coordinator_timeout,
        warnings=tuple(warnings))
