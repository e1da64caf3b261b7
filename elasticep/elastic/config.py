"""Configuration of one worker rank, shared by the launcher, `join` and the worker.

A deployment's settings are published once in the coordinator's store (as JSON) so that
a relaunched or scale-up rank needs only the coordinator address to find them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True)
class DeploymentConfig:
    """Settings every rank of a deployment shares.

    Attributes:
        model: checkpoint directory (HF layout).
        dtype: "float32" or "bfloat16".
        device: "cpu" or "cuda".
        ep_size: initial number of ranks (the launch cohort).
        max_ep_size: capacity reserved for scale-up (>= ep_size).
        ep_num_redundant_experts: R, extra physical slots over all ranks.
        ep_dispatch_algorithm: "static" (nearest replica) or "dynamic" (spread).
        enable_eplb: rebalance experts from measured load.
        eplb_rebalance_num_iterations: steps between rebalances.
        elastic_ep_backend: "elastic" (fault tolerant) or "none" (baseline: plain
            torch.distributed groups, Gloo on CPU, NCCL for CUDA tensors).
        max_total_tokens: KV-cache capacity per rank, in tokens.
        frontend_request_addr: zmq address of the front-end's ROUTER (requests).
        frontend_output_addr: zmq address of the front-end's PULL (outputs).
        heartbeat_timeout_s: seconds without heartbeat before a rank is evicted.
        max_num_seqs: most sequences in one step of one rank.
        num_threads: torch intra-op threads per rank.
        store_addr: "host:port" of the coordinator's rendezvous TCPStore; the plain
            baseline group (elastic_ep_backend="none") rendezvouses there directly.
        load_format: "auto"/"safetensors" (read the checkpoint) or "dummy" (weights
            drawn from a fixed seed, the same on every rank, so a relaunched or
            scaled-in rank holds the same experts; only config.json is needed).
        disable_cuda_graph: never replay decode CUDA graphs (CUDA ranks capture them
            per batch-size bucket otherwise, the EP exchanges running eagerly between
            the graph pieces).
        log_stats_interval_s: seconds between a rank's throughput lines (steps, tokens/s,
            CUDA graph replays; :mod:`elasticep.engine.step_rate`); 0 turns them off.
        nnodes: nodes the launch cohort is split over (``serve --nnodes``), so that the
            other nodes can refuse a layout that disagrees with node 0's.
    """

    model: str
    dtype: str = "float32"
    device: str = "cpu"
    ep_size: int = 1
    max_ep_size: int = 1
    ep_num_redundant_experts: int = 0
    ep_dispatch_algorithm: str = "static"
    enable_eplb: bool = False
    eplb_rebalance_num_iterations: int = 1000
    elastic_ep_backend: str = "elastic"
    max_total_tokens: int = 8192
    frontend_request_addr: str = ""
    frontend_output_addr: str = ""
    heartbeat_timeout_s: float = 2.0
    max_num_seqs: int = 64
    num_threads: int = 1
    store_addr: str = ""
    load_format: str = "auto"
    disable_cuda_graph: bool = False
    log_stats_interval_s: float = 10.0
    nnodes: int = 1

    def to_json(self) -> str:
        """Serialise for the coordinator store."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> DeploymentConfig:
        """Parse what :meth:`to_json` wrote.

        Raises:
            ValueError: not JSON, or unknown/missing fields.
        """
        try:
            return cls(**json.loads(text))
        except (TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"bad deployment config: {exc}") from exc


@dataclass(frozen=True)
class WorkerConfig:
    """What one worker process needs: the shared config plus its identity.

    Attributes:
        deployment: the shared settings.
        rank: global slot id, kept for life (0 <= rank < max_ep_size).
        coordinator: "host:port" of the coordinator.
        join_mode: None at launch, "recover" for a relaunched rank, "scale" for a new one.
        fault: fault injection spec such as "kill:rank=2:step=10" (tests only).
    """

    deployment: DeploymentConfig
    rank: int
    coordinator: str
    join_mode: str | None = None
    fault: str | None = None

    def to_json(self) -> str:
        """Serialise for the worker's command line."""
        d = asdict(self)
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> WorkerConfig:
        """Parse what :meth:`to_json` wrote."""
        d = json.loads(text)
        d["deployment"] = DeploymentConfig(**d["deployment"])
        return cls(**d)

    def with_rank(self, rank: int) -> WorkerConfig:
        """Same config for another slot."""
        return replace(self, rank=rank)
