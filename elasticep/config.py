"""What every rank of a deployment shares, and what one worker process needs.

Below every package of the runtime: this module imports only the standard library, so
``elastic`` (the worker), ``deploy`` (the launcher) and ``entrypoints`` (the flags) all
read one definition. A deployment's settings are published once in the coordinator's
store (as JSON, :meth:`DeploymentConfig.to_json`), so a relaunched or scale-up rank
needs only the coordinator address to find them.

:meth:`DeploymentConfig.__post_init__` checks every range and mode and raises
``ValueError`` with a message naming the command-line flag; the commands print it as
their one-line ``error:`` and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, fields, replace
from enum import Enum

from elasticep.enums import StrEnum
from elasticep.wire import Message, ProtocolError, decode, encode_json


class Backend(StrEnum):
    """``--elastic-ep-backend``: fault tolerant, or plain torch.distributed groups."""

    ELASTIC = "elastic"
    NONE = "none"


class A2ABackend(StrEnum):
    """``--moe-a2a-backend``: how the MoE dispatch/combine moves rows between ranks."""

    AUTO = "auto"  # cuda_ipc on one CUDA host (with chunked prefill), else all_to_all
    ALL_TO_ALL = "all_to_all"  # a padded all_to_all on the EP group (eager, NCCL / Gloo)
    CUDA_IPC = "cuda_ipc"  # peers write into each other's mapped buffers, inside the graph


class DispatchAlgorithm(StrEnum):
    """``--ep-dispatch-algorithm``: which replica of an expert a token goes to."""

    STATIC = "static"  # the nearest replica
    DYNAMIC = "dynamic"  # spread over the replicas


class LoadFormat(StrEnum):
    """``--load-format`` (vLLM's names): where the weights come from."""

    AUTO = "auto"
    SAFETENSORS = "safetensors"
    DUMMY = "dummy"


class JoinMode(StrEnum):
    """How a rank enters a running deployment (``join --elastic-ep-join-mode``)."""

    RECOVER = "recover"  # take back a failed slot
    SCALE = "scale"  # a new slot in free capacity


# The most --max-running-requests takes: a running request holds at least one 16-token
# KV block, so 65536 of them hold 1M KV tokens on one rank, and SGLang's and vLLM's
# defaults are in the hundreds; a larger value is a typo.
MAX_RUNNING_REQUESTS_LIMIT = 1 << 16
DTYPES = ("float32", "bfloat16")
DEVICES = ("cpu", "cuda")

# field -> the flag that sets it, where the names differ beyond "_" -> "-"
_FLAG = {"heartbeat_timeout_s": "--heartbeat-timeout",
         "log_stats_interval_s": "--log-stats-interval",
         "gc_warning_threshold_s": "--gc-warning-threshold-secs",
         "elastic_ep_scale_timeout_s": "--elastic-ep-scale-timeout"}
# field -> the argparse dest that sets it (DeploymentConfig.from_args)
_DEST = {"heartbeat_timeout_s": "heartbeat_timeout",
         "log_stats_interval_s": "log_stats_interval",
         "gc_warning_threshold_s": "gc_warning_threshold_secs",
         "coordinator_timeout_s": "coordinator_timeout",
         "elastic_ep_scale_timeout_s": "elastic_ep_scale_timeout"}


def flag_of(field_name: str) -> str:
    """The command-line flag of a :class:`DeploymentConfig` field (``ep_size`` ->
    ``--ep-size``)."""
    return _FLAG.get(field_name, "--" + field_name.replace("_", "-"))


def field_of(flag: str) -> str:
    """The :class:`DeploymentConfig` field a flag sets (the inverse of :func:`flag_of`)."""
    return next((f for f, fl in _FLAG.items() if fl == flag), flag[2:].replace("-", "_"))


def _enum(cls: type[Enum], value: object, field_name: str) -> Enum:
    try:
        return cls(value)
    except ValueError:
        choices = ", ".join(m.value for m in cls)
        raise ValueError(f"{flag_of(field_name)} must be one of {choices}, got "
                         f"{value!r}") from None


class _JsonConfig(Message):
    """``to_json`` / ``from_json`` of a config dataclass: a message of the one wire
    convention (:mod:`elasticep.wire`, modes as their strings), so a config handed to a
    worker or published for the other nodes is decoded with the same field checks as
    every other internal message."""

    def to_json(self) -> str:
        """Serialise (for the coordinator store, or a worker's command line)."""
        return encode_json(self).decode()

    @classmethod
    def from_json(cls, text: str):  # -> the subclass
        """Parse what :meth:`to_json` wrote (the type tag may be left out: the caller
        names the class).

        Raises:
            ValueError: not JSON, unknown/missing fields, a value of the wrong type or out
                of range (:class:`~elasticep.wire.ProtocolError` is one).
        """
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"bad {cls.__name__}: {exc}") from exc
        if isinstance(d, dict):
            d.setdefault("t", cls.TAG)
        try:
            return decode(d, {cls.TAG: [cls]}, cls.__name__)
        except ProtocolError as exc:
            raise ValueError(f"bad {cls.__name__}: {exc}") from exc


@dataclass(frozen=True)
class DeploymentConfig(_JsonConfig, tag="deployment_config"):
    """Settings every rank of a deployment shares.

    Attributes:
        model: checkpoint directory (HF layout).
        dtype: "float32" or "bfloat16".
        device: "cpu" or "cuda".
        ep_size: initial number of ranks (the launch cohort).
        max_ep_size: capacity reserved for scale-up (>= ep_size); None (the default):
            ``ep_size``, no reserve, so ``DeploymentConfig(model=m, ep_size=2)`` is whole.
        min_ep_size: the fewest ranks whose expert slots must hold every expert without
            growing (``--min-ep-size``, in ``[1, ep_size]``); None: ``ep_size - 1`` (at
            least 1) for the elastic backend, ``ep_size`` for none. See
            :attr:`slot_reserve_ranks`.
        ep_num_redundant_experts: R, extra physical slots over all ranks.
        ep_dispatch_algorithm: static (nearest replica) or dynamic (spread).
        enable_eplb: rebalance experts from measured load.
        eplb_rebalance_num_iterations: steps between rebalances.
        elastic_ep_backend: elastic (fault tolerant) or none (baseline: plain
            torch.distributed groups, Gloo on CPU, NCCL for CUDA tensors).
        max_total_tokens: KV-cache capacity per rank, in tokens; None: sized from the
            GPU's memory on CUDA (``mem_fraction_static``), 8192 on CPU.
        mem_fraction_static: fraction of a GPU's memory for weights and KV cache, split
            by the ranks that share the GPU (SGLang's meaning); None: the default
            (:mod:`elasticep.engine.limits`). CUDA only.
        max_running_requests: most sequences in one step of one rank; None: derived
            per rank from its KV capacity on CUDA, 64 on CPU.
        cuda_graph_max_bs: largest decode batch captured in a CUDA graph; None: the
            smaller of max_running_requests (where given) and 256.
        chunked_prefill_size: most prefill tokens of one step (SGLang's meaning); -1:
            no chunking; None: 8192 on CUDA, no chunking on CPU.
        max_num_batched_tokens: most tokens of one step, decodes included (vLLM's
            meaning; :mod:`elasticep.engine.admission`); None: the larger of 4096 and
            the chunk.
        frontend_request_addr: zmq address of the front-end's ROUTER (requests).
        frontend_output_addr: zmq address of the front-end's PULL (outputs).
        frontend_extra_request_addrs, frontend_extra_output_addrs: the links of the
            node's other front-end processes (``serve --api-server-count``), pairwise;
            every rank links to each of them too, for the deployment's life.
        heartbeat_timeout_s: seconds without heartbeat before a rank is evicted.
        elastic_ep_scale_timeout_s: how long a grow waits for its joiners before it
            gives up and frees their slots (seconds; SGLang's ``--elastic-ep-scale-timeout``).
        num_threads: torch intra-op threads per rank.
        store_addr: "host:port" of the coordinator's rendezvous TCPStore; the plain
            baseline group (elastic_ep_backend none) rendezvouses there directly.
        load_format: auto/safetensors (read the checkpoint) or dummy (weights drawn
            from a fixed seed, the same on every rank, so a relaunched or scaled-in
            rank holds the same experts; only config.json is needed).
        quantization: None, or "fp8": quantize an unquantized checkpoint to block FP8
            (128 x 128 blocks, DeepSeek-V3's format) while loading (SGLang's and vLLM's
            ``--quantization``). A block-FP8 checkpoint is read as such without it.
        disable_cuda_graph: never replay decode CUDA graphs (CUDA ranks capture them
            per batch-size bucket otherwise, the EP exchanges running eagerly between
            the graph pieces).
        skip_server_warmup: start serving without the prefill warm-up (SGLang's flag;
            CUDA ranks otherwise run dummy steps of every prefill shape bucket before
            they are ready, :mod:`elasticep.engine.prefill_warmup`).
        log_stats_interval_s: seconds between a rank's throughput lines (steps, tokens/s,
            CUDA graph replays; :mod:`elasticep.engine.step_rate`); 0 turns them off.
        gc_warning_threshold_s: a rank or front-end process logs a warning for every
            garbage collection longer than this (seconds, :mod:`elasticep.utils.gc_pauses`,
            SGLang's ``--gc-warning-threshold-secs``); 0 turns it off.
        coordinator_timeout_s: serve's ``--coordinator-timeout`` (seconds): also the
            longest a rank waits on a coordinator whose host still acknowledges (a
            stalled ``serve``), keeping its state, before it gives up.
        moe_a2a_backend: the dispatch/combine transport (:class:`A2ABackend`); cuda_ipc
            needs CUDA, one node and a bounded step (chunked prefill on).
        nnodes: nodes the launch cohort is split over (``serve --nnodes``), so that the
            other nodes can refuse a layout that disagrees with node 0's.
        membership_store: serve's ``--membership-store``: ``embedded`` (the default), or
            ``etcd://...``, with which a rank that loses its coordinator finds the new
            leader there and resumes with it instead of exiting.

    Raises:
        ValueError: (at construction) a value out of range or an unknown mode, naming
            its flag, e.g. ``--ep-size must be >= 1, got 0``.
    """

    model: str
    dtype: str = "float32"
    device: str = "cpu"
    ep_size: int = 1
    max_ep_size: int | None = None  # an int once constructed (__post_init__)
    min_ep_size: int | None = None
    ep_num_redundant_experts: int = 0
    ep_dispatch_algorithm: DispatchAlgorithm = DispatchAlgorithm.STATIC
    enable_eplb: bool = False
    eplb_rebalance_num_iterations: int = 1000
    elastic_ep_backend: Backend = Backend.ELASTIC
    max_total_tokens: int | None = None
    mem_fraction_static: float | None = None
    max_running_requests: int | None = None
    cuda_graph_max_bs: int | None = None
    chunked_prefill_size: int | None = None
    max_num_batched_tokens: int | None = None
    frontend_request_addr: str = ""
    frontend_output_addr: str = ""
    frontend_extra_request_addrs: tuple[str, ...] = ()
    frontend_extra_output_addrs: tuple[str, ...] = ()
    heartbeat_timeout_s: float = 2.0
    elastic_ep_scale_timeout_s: float = 600.0
    num_threads: int = 1
    store_addr: str = ""
    load_format: LoadFormat = LoadFormat.AUTO
    quantization: str | None = None
    disable_cuda_graph: bool = False
    skip_server_warmup: bool = False
    log_stats_interval_s: float = 10.0
    gc_warning_threshold_s: float = 0.0
    nnodes: int = 1
    moe_a2a_backend: A2ABackend = A2ABackend.AUTO
    coordinator_timeout_s: float = 60.0
    membership_store: str = "embedded"

    def __post_init__(self) -> None:
        if self.max_ep_size is None:  # no scale-up reserve unless asked for
            object.__setattr__(self, "max_ep_size", self.ep_size)
        for name, cls in (("ep_dispatch_algorithm", DispatchAlgorithm),
                          ("elastic_ep_backend", Backend), ("load_format", LoadFormat),
                          ("moe_a2a_backend", A2ABackend)):
            object.__setattr__(self, name, _enum(cls, getattr(self, name), name))
        for name, choices in (("dtype", DTYPES), ("device", DEVICES)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{flag_of(name)} must be one of {', '.join(choices)}, got "
                                 f"{getattr(self, name)!r}")
        checks = [
            (self.ep_size >= 1, f"--ep-size must be >= 1, got {self.ep_size}"),
            (self.quantization in (None, "fp8"),
             f"--quantization must be fp8 (or unset), got {self.quantization!r}"),
            (self.max_ep_size >= self.ep_size,
             f"--max-ep-size ({self.max_ep_size}) must be >= --ep-size ({self.ep_size})"),
            (self.min_ep_size is None or 1 <= self.min_ep_size <= self.ep_size,
             f"--min-ep-size must be in [1, --ep-size ({self.ep_size})], got "
             f"{self.min_ep_size}"),
            (self.ep_num_redundant_experts >= 0, "--ep-num-redundant-experts must be >= 0"),
            (self.eplb_rebalance_num_iterations >= 1,
             "--eplb-rebalance-num-iterations must be >= 1"),
            (self.max_total_tokens is None or self.max_total_tokens >= 16,
             "--max-total-tokens must be >= 16"),
            (self.mem_fraction_static is None or 0 < self.mem_fraction_static < 1,
             f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}"),
            (self.max_running_requests is None
             or 1 <= self.max_running_requests <= MAX_RUNNING_REQUESTS_LIMIT,
             f"--max-running-requests must be in [1, {MAX_RUNNING_REQUESTS_LIMIT}], got "
             f"{self.max_running_requests}"),
            (self.cuda_graph_max_bs is None or self.cuda_graph_max_bs >= 1,
             f"--cuda-graph-max-bs must be >= 1, got {self.cuda_graph_max_bs}"),
            (self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
             f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}"),
            (self.chunked_prefill_size in (None, -1) or self.chunked_prefill_size >= 1,
             f"--chunked-prefill-size must be >= 1, or -1 (off), got "
             f"{self.chunked_prefill_size}"),
            (self.num_threads >= 1, f"num_threads must be >= 1, got {self.num_threads}"),
            (0 < self.heartbeat_timeout_s < math.inf,
             "--heartbeat-timeout must be a finite number of seconds > 0"),
            (0 < self.elastic_ep_scale_timeout_s < math.inf,
             "--elastic-ep-scale-timeout must be a finite number of seconds > 0"),
            (0 <= self.log_stats_interval_s < math.inf,
             "--log-stats-interval must be a finite number of seconds >= 0 (0: off)"),
            (0 <= self.gc_warning_threshold_s < math.inf,
             "--gc-warning-threshold-secs must be a finite number of seconds >= 0 (0: off)"),
            (self.nnodes >= 1, f"--nnodes must be >= 1, got {self.nnodes}"),
            (0 < self.coordinator_timeout_s < math.inf,
             "--coordinator-timeout must be a finite number of seconds > 0"),
            (self.elastic_ep_backend == Backend.ELASTIC or self.max_ep_size == self.ep_size,
             "--elastic-ep-backend none cannot scale: drop --max-ep-size"),
            (self.elastic_ep_backend == Backend.ELASTIC or self.min_ep_size in (None, self.ep_size),
             "--elastic-ep-backend none cannot survive a failure, so it reserves no expert "
             "slots: drop --min-ep-size"),
            (self.moe_a2a_backend != A2ABackend.CUDA_IPC
             or (self.device == "cuda" and self.nnodes == 1 and self.chunked_prefill_size != -1),
             "--moe-a2a-backend cuda_ipc needs --device cuda, --nnodes 1 and chunked prefill "
             "(not --chunked-prefill-size -1)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def slot_reserve_ranks(self) -> int:
        """:attr:`min_ep_size` resolved: every rank launches with enough expert slots
        (``ceil(E / this)``, the extra ones empty) that a membership change keeping this
        many ranks re-homes orphans without growing the slots, so no survivor's tensors
        change shape and no CUDA graph is captured again. The memory is taken at launch,
        where the KV cache is sized from what is left, rather than at a failure, when it
        may not be free."""
        if self.min_ep_size is not None:
            return self.min_ep_size
        if self.elastic_ep_backend != Backend.ELASTIC:
            return self.ep_size
        return max(1, self.ep_size - 1)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides: object) -> DeploymentConfig:
        """Build from the flags of ``add_deployment_arguments`` (a flag a command does not
        take keeps its default; ``--max-ep-size`` unset means ``--ep-size``).

        Args:
            args: parsed flags.
            overrides: fields to set instead of the flags' values (e.g. the resolved
                model directory).

        Raises:
            ValueError: as the constructor, naming the flag.
        """
        values = {}
        for f in fields(cls):
            dest = _DEST.get(f.name, f.name)
            if hasattr(args, dest) and getattr(args, dest) is not None:
                values[f.name] = getattr(args, dest)
        values.setdefault("max_ep_size", values.get("ep_size", 1))
        return cls(**(values | overrides))


@dataclass(frozen=True)
class WorkerConfig(_JsonConfig, tag="worker_config"):
    """What one worker process needs: the shared config plus its identity.

    Attributes:
        deployment: the shared settings.
        rank: global slot id, kept for life (0 <= rank < max_ep_size).
        coordinator: "host:port" of the coordinator.
        join_mode: None at launch, recover for a relaunched rank, scale for a new one.
        fault: fault injection spec such as "kill:rank=2:step=10" (tests only).

    Raises:
        ValueError: (at construction) an unknown join mode.
    """

    deployment: DeploymentConfig
    rank: int
    coordinator: str
    join_mode: JoinMode | None = None
    fault: str | None = None

    def __post_init__(self) -> None:
        if self.join_mode is not None:
            try:
                object.__setattr__(self, "join_mode", JoinMode(self.join_mode))
            except ValueError:
                raise ValueError(f"unknown join mode {self.join_mode!r} (recover or "
                                 "scale)") from None

    def with_rank(self, rank: int) -> WorkerConfig:
        """Same config for another slot."""
        return replace(self, rank=rank)
