"""The flags of a deployment (SGLang's names), shared by ``serve`` and ``generate``.

One declaration per flag: the defaults are :class:`~elasticep.config.DeploymentConfig`'s,
and :func:`deployment_config` turns the parsed flags into one (its ``__post_init__``
checks them) or raises :class:`UsageError` with the message naming the flag.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from elasticep.config import (
    DEVICES,
    DTYPES,
    MAX_RUNNING_REQUESTS_LIMIT,
    A2ABackend,
    Backend,
    DeploymentConfig,
    DispatchAlgorithm,
    field_of,
)
from elasticep.engine.limits import (
    CPU_MAX_RUNNING_REQUESTS,
    CPU_MAX_TOTAL_TOKENS,
    DEFAULT_CHUNKED_PREFILL_SIZE,
    DEFAULT_CUDA_GRAPH_MAX_BS,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MEM_FRACTION_STATIC,
    KV_TOKENS_PER_REQUEST,
    MAX_RUNNING_REQUESTS_CAP,
)
from elasticep.entrypoints.validate import UsageError, add_load_format_argument, default_model_dir
from elasticep.models.config import SUPPORTED_FAMILIES
from elasticep.moe.exchange import stream_memops

Group = argparse.ArgumentParser | argparse._ArgumentGroup


def _add(group: Group, flag: str, help: str, **kw: object) -> None:
    """One flag of a :class:`DeploymentConfig` field; its default is the field's (a mode
    as its string), unless ``kw`` gives one."""
    field = DeploymentConfig.__dataclass_fields__.get(field_of(flag))
    if "default" not in kw and field is not None and kw.get("action") != "store_true":
        kw["default"] = getattr(field.default, "value", field.default)
    if kw.get("type") is int:
        kw.setdefault("metavar", "N")
    group.add_argument(flag, help=help, **kw)


def add_deployment_arguments(p: argparse.ArgumentParser) -> dict[str, argparse._ArgumentGroup]:
    """Add every flag of :class:`DeploymentConfig` to ``p``, in groups.

    Returns:
        The groups by title ("model", "memory and scheduling", "expert parallelism",
        "fault tolerance", "logging and metrics"), so a command adds its own flags
        beside them.
    """
    m = p.add_argument_group("model")
    m.add_argument("--model", "--model-path", dest="model", default=str(default_model_dir()),
                   metavar="PATH",
                   help=f"HF checkpoint directory ({', '.join(SUPPORTED_FAMILIES)}); "
                        "default: the embedded demo model")
    _add(m, "--dtype", "weight/activation dtype (default: %(default)s)", choices=DTYPES)
    add_load_format_argument(m)
    _add(m, "--quantization", "quantize an unquantized checkpoint's linear weights to "
         "block-scaled FP8 (e4m3, 128x128 blocks: DeepSeek-V3's format) while loading; a "
         "block-FP8 checkpoint is read as such without this flag, and any other "
         "quantization_config is refused", choices=["fp8"])
    _add(m, "--disable-cuda-graph", "run decode eagerly instead of replaying CUDA graphs "
         "captured at start-up per batch-size bucket (CUDA only; with expert parallelism the "
         "exchanges between ranks stay outside the graphs)", action="store_true")
    _add(m, "--skip-server-warmup", "be ready without first running dummy prefill steps of "
         "every shape bucket up to the step budget (CUDA only; they keep kernel compilation "
         "off the request path)", action="store_true")
    _add(m, "--device", "where weights and compute live (cuda: rank r on GPU r mod the GPU "
         "count; the expert exchange as --moe-a2a-backend picks, control traffic over Gloo)",
         choices=DEVICES)
    k = p.add_argument_group("memory and scheduling (per rank; SGLang's names)")
    _add(k, "--max-total-tokens", "KV-cache capacity per rank, in tokens; overrides "
         "--mem-fraction-static (default: sized from GPU memory on CUDA, "
         f"{CPU_MAX_TOTAL_TOKENS} on CPU)", type=int)
    _add(k, "--mem-fraction-static", "fraction of a GPU's memory for weights and KV cache; "
         "the rest stays for activations, CUDA graphs and exchange buffers. Ranks that share "
         "a GPU (rank r uses GPU r mod the GPU count; --max-ep-size slots counted) split it "
         f"(CUDA; default: {DEFAULT_MEM_FRACTION_STATIC})", type=float, metavar="F")
    k.add_argument("--max-running-requests", "--max-num-seqs", dest="max_running_requests",
                   type=int, default=None, metavar="N",
                   help="most requests one rank runs at once; the front-end routes no more "
                        "to a rank (default: on CUDA its KV tokens / "
                        f"{KV_TOKENS_PER_REQUEST}, at most {MAX_RUNNING_REQUESTS_CAP}; "
                        f"{CPU_MAX_RUNNING_REQUESTS} on CPU; at most "
                        f"{MAX_RUNNING_REQUESTS_LIMIT})")
    _add(k, "--cuda-graph-max-bs", "largest decode batch captured in a CUDA graph (bigger "
         "batches run eagerly); the same on every rank; above --max-running-requests it "
         "is lowered to it, with a warning (default: --max-running-requests if given, at "
         f"most {DEFAULT_CUDA_GRAPH_MAX_BS})", type=int)
    _add(k, "--chunked-prefill-size", "most prompt tokens prefilled in one step, so a long "
         "prompt shares steps with running decodes; -1 turns chunking off (default: "
         f"{DEFAULT_CHUNKED_PREFILL_SIZE} on CUDA, off on CPU)", type=int)
    _add(k, "--max-num-batched-tokens", "most tokens one step forwards, decodes included: "
         "every running decode gets its token each step and new prompts' chunks fill the "
         "rest, so a new request starts in the next step and the step (hence the running "
         "streams' inter-token latency) stays bounded (default: the larger of "
         f"{DEFAULT_MAX_NUM_BATCHED_TOKENS} and --chunked-prefill-size)", type=int)
    e = p.add_argument_group("expert parallelism")
    _add(e, "--ep-size", "number of ranks to start; each hosts a share of the experts and "
         "serves its own requests (default: %(default)s)", type=int)
    _add(e, "--max-ep-size", "capacity reserved for scale-up (default: --ep-size)", type=int,
         default=None)
    _add(e, "--min-ep-size", "fewest ranks that keep CUDA graphs and expert slots through "
         "failures: each rank reserves ceil(experts / N) slots at launch, so the survivors "
         "of a death (or a scale-down) down to N ranks take in the orphaned experts without "
         "new tensors or a graph re-capture; below N the slots grow then. Costs expert "
         "memory at launch, before the KV cache is sized (default: one less than "
         "--ep-size, at least 1; equal to --ep-size: no reserve)", type=int)
    _add(e, "--ep-num-redundant-experts", "extra physical expert slots (replicas) over all "
         "ranks", type=int)
    _add(e, "--ep-dispatch-algorithm", "replica choice: static = nearest, dynamic = spread",
         choices=[m.value for m in DispatchAlgorithm])
    _add(e, "--enable-eplb", "rebalance experts from measured load", action="store_true")
    _add(e, "--eplb-rebalance-num-iterations", "steps between EPLB rebalances (default: "
         "%(default)s)", type=int)
    _add(e, "--elastic-ep-backend", "elastic: survive rank failures; none: plain "
         "torch.distributed groups (Gloo on CPU, NCCL for CUDA tensors), no fault tolerance "
         "(a rank failure stops the deployment)", choices=[m.value for m in Backend])
    _add(e, "--moe-a2a-backend", "MoE dispatch/combine transport: cuda_ipc = ranks of one "
         "host write into each other's mapped GPU buffers inside the decode CUDA graph (one "
         "graph per step); all_to_all = a padded all_to_all on the EP group between graph "
         "pieces; auto = cuda_ipc on one CUDA node, else all_to_all (default: %(default)s)",
         choices=[m.value for m in A2ABackend])
    f = p.add_argument_group("fault tolerance")
    _add(f, "--heartbeat-timeout", "seconds without heartbeat before a frozen rank is "
         "evicted (default: %(default)s)", type=float, metavar="S")
    f.add_argument("--elastic-ep-scale-timeout", "--scale-timeout", type=float, metavar="S",
                   default=DeploymentConfig.elastic_ep_scale_timeout_s,
                   help="seconds a grow (POST /scale_elastic_ep) waits for its joiners "
                        "before it gives up and frees their slots (default: %(default)s)")
    g = p.add_argument_group("logging and metrics")
    _add(g, "--log-stats-interval", "seconds between each rank's throughput log line (steps, "
         "generated tokens/s, decode steps replayed from CUDA graphs and run eagerly); 0 turns "
         "it off (default: %(default)s)",
         type=float, metavar="S")
    _add(g, "--gc-warning-threshold-secs", "log a warning for every garbage collection of a "
         "rank or front-end process longer than this many seconds (SGLang's flag); 0 turns "
         "it off (default: %(default)s)", type=float, metavar="S")
    return {"model": m, "memory and scheduling": k, "expert parallelism": e,
            "fault tolerance": f, "logging and metrics": g}


def clamp_cuda_graph_max_bs(cuda_graph_max_bs: int | None, max_running_requests: int | None,
                            ) -> tuple[int | None, str | None]:
    """``--cuda-graph-max-bs`` no larger than ``--max-running-requests`` (pure): no rank
    runs a bigger decode batch, so graphs above it would only cost capture time and
    memory. SGLang warns; we lower it too.

    Returns:
        ``(cuda_graph_max_bs, warning)``: the value to use, and the warning to print
        where it was lowered (else None).
    """
    if cuda_graph_max_bs is None or max_running_requests is None \
            or cuda_graph_max_bs <= max_running_requests:
        return cuda_graph_max_bs, None
    return max_running_requests, (
        f"--cuda-graph-max-bs {cuda_graph_max_bs} is above --max-running-requests "
        f"{max_running_requests}: no decode batch is larger, so graphs are captured up to "
        f"{max_running_requests}")


def deployment_config(args: argparse.Namespace, warnings: list[str] | None = None,
                      **overrides: object) -> DeploymentConfig:
    """:meth:`DeploymentConfig.from_args`, its ``ValueError`` as a :class:`UsageError`,
    with ``--cuda-graph-max-bs`` lowered to ``--max-running-requests``
    (:func:`clamp_cuda_graph_max_bs`).

    Args:
        args: parsed flags of :func:`add_deployment_arguments`.
        warnings: where a non-fatal remark is appended; None: printed to stderr.
        overrides: fields to set instead of the flags' values.

    Raises:
        UsageError: a flag out of range or a bad combination, naming the flag.
    """
    try:
        config = DeploymentConfig.from_args(args, **overrides)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if config.moe_a2a_backend == A2ABackend.CUDA_IPC:
        try:
            stream_memops.driver()
        except ImportError as exc:  # say so now, not from every rank after loading
            raise UsageError(f"--moe-a2a-backend cuda_ipc: {exc}") from None
    graph_bs, warning = clamp_cuda_graph_max_bs(config.cuda_graph_max_bs,
                                                config.max_running_requests)
    if warning is None:
        return config
    if warnings is None:
        print(f"elasticep: warning: {warning}", file=sys.stderr)
    else:
        warnings.append(warning)
    return replace(config, cuda_graph_max_bs=graph_bs)
