"""The worker process of one EP rank: ``python -m elasticep.elastic.worker --config-json JSON``.

``JSON`` is :meth:`WorkerConfig.to_json`. The worker:

1. dies with its parent (the launcher) and logs with rank and epoch on every line (a
   joiner of a `join` that hands its ranks over stops dying with it once admitted);
2. loads the model with only its local expert slots of the launch placement
   (``slots_per_rank = ceil((E + R) / ep_size)``, capacity ``max_ep_size``);
3. joins the WORLD group (the elastic backend with ``on_failure="raise"`` through the
   coordinator, or, for the baseline ``elastic_ep_backend="none"`` with no fault
   tolerance, a plain torch.distributed group over the coordinator's TCPStore: Gloo on
   CPU, ``"cpu:gloo,cuda:nccl"`` on CUDA so the MoE all_to_alls of CUDA tensors run on
   NCCL and the step loop's CPU collectives on Gloo) and plugs the EP executor of the
   weights' device (:func:`~elasticep.moe.cuda_executor.make_ep_executor`) over WORLD
   into the model; a joiner
   (``join_mode`` "recover" or "scale") loads no expert, registers ready and blocks in
   ``join_group`` until the survivors admit it, then receives the placement and its
   experts from peers;
4. warms the prefill shapes of its step budget on CUDA
   (:mod:`~elasticep.engine.prefill_warmup`, unless ``--skip-server-warmup``; a joiner
   too, on its stand-in experts, before it asks for admission), so no request compiles
   a kernel;
5. says hello to the front-end and runs :class:`~elasticep.elastic.step_loop.LockstepLoop`.

Exit codes: 0 after a planned removal, 3 when the coordinator is lost or this rank was
evicted, 1 on any other error. A rank retired with ``keep_processes`` does not exit: it
drops its model and idles, out of every group, until SIGTERM or SIGINT (then 0) or its
launcher's exit. Fault injection: see :mod:`elasticep.elastic.fault_injection`.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
import threading
import traceback
from datetime import timedelta

from elasticep.utils.procs import PARENT_PID_ENV, die_with_parent, outlive_parent

if __name__ == "__main__":
    # Before the imports below, which take seconds: a launcher (serve, join) killed
    # meanwhile must not leave this rank running on its own.
    die_with_parent(int(os.environ.get(PARENT_PID_ENV, "0")) or None)

import torch
import torch.distributed as dist

import elasticep.distributed as ed
from elasticep.config import A2ABackend, Backend, WorkerConfig
from elasticep.distributed.api import DEFAULT_TIMEOUT_S
from elasticep.distributed.control import stall_grace_s
from elasticep.elastic import serve_loop
from elasticep.elastic.exchange_setup import (
    build_exchange,
    exchange_store,
    resolve_a2a_backend,
    sync_exchange,
)
from elasticep.elastic.exit_code import ExitCode
from elasticep.elastic.fault_injection import FaultInjector
from elasticep.elastic.join import join_as_new_rank
from elasticep.elastic.log_context import RankContext, setup_worker_logging
from elasticep.elastic.rank_model import (
    CheckpointExperts,
    attach_ep_executor,
    load_rank_weights,
    warmup_step_context,
)
from elasticep.elastic.step_loop import LockstepLoop
from elasticep.elastic.step_profiler import StepProfiler
from elasticep.engine.limits import measure_rank_limits
from elasticep.engine.llm_engine import LLMEngine, grammar_compiler_for
from elasticep.engine.prefill_warmup import warm_up_prefill
from elasticep.eplb import EPLBConfig, EPLBManager, initial_placement
from elasticep.frontend_link import LinkEndpoints
from elasticep.frontend_link.fanout import extra_endpoints, worker_link
from elasticep.membership.transitions import OnFailure
from elasticep.models import load_model_config
from elasticep.moe.peer_weights import PeerWeights
from elasticep.utils.gc_pauses import warn_long_collections

logger = logging.getLogger("elasticep.worker")


def init_world(cfg: WorkerConfig) -> dist.ProcessGroup:
    """Step 2: the WORLD group (``size() == max_ep_size`` for the elastic backend).

    Raises:
        ValueError: the coordinator refused this rank; TimeoutError: unreachable.
    """
    d = cfg.deployment
    if d.elastic_ep_backend == Backend.ELASTIC:
        return ed.init_process_group(
            cfg.coordinator, cfg.rank, d.ep_size, max_world_size=d.max_ep_size,
            is_extension=cfg.join_mode is not None, on_failure=OnFailure.RAISE,
            stall_grace_s=stall_grace_s(d.coordinator_timeout_s, d.heartbeat_timeout_s),
            membership_store=d.membership_store if d.membership_store.startswith("etcd")
            else None)
    if cfg.join_mode is not None:
        raise ValueError("the plain baseline group cannot take joiners")
    host, _, port = d.store_addr.rpartition(":")
    store = dist.TCPStore(host, int(port), is_master=False,
                          timeout=timedelta(seconds=DEFAULT_TIMEOUT_S))
    dist.init_process_group(baseline_backend(d.device),
                            store=dist.PrefixStore("plain-baseline", store),
                            rank=cfg.rank, world_size=d.ep_size,
                            timeout=timedelta(seconds=DEFAULT_TIMEOUT_S))
    return dist.distributed_c10d._get_default_group()


def baseline_backend(device: str) -> str:
    """The torch backend string of the plain baseline group for ``device``.

    CPU: ``"gloo"``. CUDA: ``"cpu:gloo,cuda:nccl"``, so CPU tensors (the step loop's
    header and commit) go to Gloo and CUDA tensors (the EP dispatch/combine) to NCCL.
    No ``device_id``: NCCL makes its communicator lazily on the current device, which
    :func:`load_rank_weights` (run before the group) made the rank's GPU. Sets
    ``NCCL_NVLS_ENABLE=0`` unless set (as the elastic backend's NCCL groups do).
    """
    if not device.startswith("cuda"):
        return "gloo"
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    return "cpu:gloo,cuda:nccl"


def build_loop(cfg: WorkerConfig, log_ctx: RankContext) -> LockstepLoop:
    """Steps 2-4 up to the loop: weights (before joining the group, so a long load owes
    the coordinator no heartbeats), WORLD, executor, engine, admission, channel."""
    d = cfg.deployment
    elastic = d.elastic_ep_backend == Backend.ELASTIC
    mcfg = load_model_config(d.model)
    max_ep = d.max_ep_size if elastic else d.ep_size
    # The launch placement; a joiner uses it only as a stand-in until admitted.
    placement = initial_placement(mcfg.num_hidden_layers, mcfg.num_experts,
                                  d.ep_num_redundant_experts, d.ep_size, max_ep,
                                  min_ep_size=d.slot_reserve_ranks)
    joining = cfg.join_mode is not None
    model = load_rank_weights(d.model, placement, cfg.rank, getattr(torch, d.dtype), d.device,
                              with_experts=not joining, load_format=d.load_format,
                              quantization=d.quantization)
    logger.info("weights loaded: %d local slots per layer (%s)", model.experts.num_slots,
                "joiner: experts come from peers" if joining else "launch placement")
    a2a = resolve_a2a_backend(d)
    # allocated before the KV cache is sized, so its buffers count as static memory
    exchange = (build_exchange(d, mcfg, cfg.rank, model.device)
                if a2a == A2ABackend.CUDA_IPC else None)
    # sized now, with this rank's weights on its GPU (a joiner counts the experts its
    # peers will send); the exchange's shape comes from the config alone (engine.limits)
    limits = measure_rank_limits(d, mcfg, cfg.rank, placement.slots_per_rank
                                 - model.experts.num_slots)
    logger.info("limits: %d KV tokens, max_running_requests %d, cuda_graph_max_bs %d, "
                "chunked_prefill_size %s", limits.max_total_tokens,
                limits.max_running_requests, limits.cuda_graph_max_bs,
                limits.chunked_prefill_size)
    faults = FaultInjector.from_config(cfg.rank, cfg.fault)
    faults.at_loading()
    group = init_world(cfg)
    ep, hooked = attach_ep_executor(model, placement, cfg.rank, group, d.ep_dispatch_algorithm)
    store = None
    if exchange is not None:
        store = exchange_store(d, DEFAULT_TIMEOUT_S)
        exchange.publish(store)
        exchange.warm_kernels()
        ep.transport = exchange
        # no NCCL communicator is built for the group (ranks may share a GPU): expert
        # weights move as device copies from the peers' mapped tensors
        ep.peer_weights = PeerWeights(cfg.rank, store)
        if isinstance(store, ed.LeaderStore):  # a new leader's store starts empty
            store.republish += [exchange.republish, ep.peer_weights.republish]
        if not joining:  # a joiner publishes once admitted (it holds nothing before)
            ep.peer_weights.publish(ep.w13, ep.w2)
            sync_exchange(exchange, store, ed.get_active_ranks(group).to(torch.bool)
                          if elastic else torch.ones(d.ep_size, dtype=torch.bool))
    logger.info("MoE transport: %s", a2a.value)
    load_fn = CheckpointExperts(model, d.model, d.load_format, quantization=d.quantization)
    if faults.has_layer_faults:  # each hook is an eager break in a captured decode graph
        hooked.hooks.append(lambda layer, _ids: faults.at_layer(layer))
    eplb = None
    if d.enable_eplb:
        eplb = EPLBManager(mcfg.num_hidden_layers, mcfg.num_experts,
                           EPLBConfig(True, d.eplb_rebalance_num_iterations), rank=cfg.rank)
        hooked.hooks.append(eplb.record)
    engine = LLMEngine(model, limits.engine_config(forward_empty_batches=True,
                                                   enable_cuda_graph=not d.disable_cuda_graph),
                       grammar_compiler=grammar_compiler_for(d.model, mcfg))
    warm_up_prefill(engine, warmup_step_context(model, ep), skip=d.skip_server_warmup)
    if joining:
        logger.info("waiting for admission (%s)", cfg.join_mode)
        # a member outlives a `join` that hands it over (see RankLauncher's ``outlive``)
        report = join_as_new_rank(ep, group, load_fn, DEFAULT_TIMEOUT_S * 10,
                                  on_member=outlive_parent)
        log_ctx.epoch = ed.get_current_epoch(group)
        if exchange is not None:
            sync_exchange(exchange, store, ed.get_active_ranks(group).to(torch.bool))
        logger.info("admitted: %d experts copied from peers, %d reloaded, %.3fs",
                    report.peer_copies, report.reloads, report.seconds)
    channel = worker_link(LinkEndpoints(d.frontend_request_addr, d.frontend_output_addr),
                          cfg.rank, d.membership_store, log_ctx.epoch,
                          limits=(engine.blocks.capacity_tokens, limits.max_running_requests),
                          moe_a2a_backend=a2a.value,
                          extra=extra_endpoints(d.frontend_extra_request_addrs,
                                                d.frontend_extra_output_addrs))
    channel.hello()
    return LockstepLoop(engine, ep, channel, group, cfg.rank, elastic, load_fn, faults,
                        log_ctx, eplb, log_stats_interval_s=d.log_stats_interval_s,
                        profiler=StepProfiler.from_env(cfg.rank, d.device),
                        exchange=exchange, exchange_store=store,
                        exchange_deadline_s=max(30.0, 4 * d.heartbeat_timeout_s))


def run_worker(cfg: WorkerConfig) -> tuple[int, bool]:
    """Run one rank until it is removed, evicted, or loses the coordinator.

    Returns:
        The exit code, and whether a removal asked this process to stay up
        (``keep_processes``; see :func:`idle_until_stopped`).
    """
    log_ctx = setup_worker_logging(cfg.rank)
    warn_long_collections(cfg.deployment.gc_warning_threshold_s)
    torch.set_num_threads(cfg.deployment.num_threads)
    logger.info("worker pid %d starting (join_mode=%s, backend=%s)", os.getpid(), cfg.join_mode,
                cfg.deployment.elastic_ep_backend)
    loop = None
    try:
        loop = build_loop(cfg, log_ctx)
        loop.run()
        return ExitCode.ERROR, False  # run() only returns by raising
    except ed.RankRemovedError as exc:  # before its base class, RankEvictedError
        logger.info("%s; %s", exc, "staying up, idle, until stopped (keep_processes)"
                    if exc.keep_process else "exiting cleanly")
        return ExitCode.REMOVED, exc.keep_process
    except (ed.CoordinatorLostError, ed.RankEvictedError) as exc:
        logger.error("stopping: %s: %s", type(exc).__name__, exc)
        return ExitCode.LOST, False
    except Exception as exc:  # noqa: BLE001 - report every failure with rank and epoch, then exit
        logger.error("worker failed:\n%s", traceback.format_exc())
        if loop is not None:
            report_step_failure(loop, exc)
        return ExitCode.ERROR, False
    finally:
        if loop is not None:
            s = loop.stats
            logger.info("exit after %d steps, %d recoveries, %d redone steps, %d reloads; "
                        "last commit at epoch %d, time %.3f", s.steps, s.recoveries, s.redos,
                        s.reloads, s.last_commit_epoch, s.last_commit_time)
            loop.channel.close()
        for h in logging.getLogger().handlers:
            h.flush()


def idle_until_stopped() -> None:
    """Stay up, idle, after a removal with ``keep_processes``: the model and its memory
    are dropped (the caller's loop is gone), the control connection stays, so the
    coordinator still sees this pid in the retired slot and refuses another worker there
    until it is stopped. Returns on SIGTERM or SIGINT; the launcher's exit kills it
    (``die_with_parent``)."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    logger.info("retired: idle until SIGTERM (pid %d)", os.getpid())
    for h in logging.getLogger().handlers:
        h.flush()
    while not stop.wait(1.0):  # a timed wait: the handler runs between waits
        pass
    logger.info("stopped while idle; exiting cleanly")


def report_step_failure(loop: LockstepLoop, exc: BaseException) -> None:
    """Blame ``exc`` on the requests of the step it came from (the front-end fails a
    request that crashed two ranks, instead of resubmitting it again); best effort."""
    serve_loop.report_step_failure(loop.channel, loop.step_request_ids(), exc)


def main(argv: list[str] | None = None) -> None:
    """CLI entry: parse ``--config-json`` and run; exits with the worker's code.

    Run as ``python -m``, whose module prologue already tied this process to its
    launcher (``die_with_parent``). ``os._exit`` skips interpreter teardown, which can
    hang on Gloo threads of a group whose peers are gone.
    """
    ap = argparse.ArgumentParser(description="ElasticEP worker rank")
    ap.add_argument("--config-json", required=True, help="WorkerConfig.to_json()")
    args = ap.parse_args(argv)
    cfg = WorkerConfig.from_json(args.config_json)
    code, keep = run_worker(cfg)
    if keep:
        idle_until_stopped()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
