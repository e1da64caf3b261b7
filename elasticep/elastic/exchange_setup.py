"""Which MoE transport a rank runs (``--moe-a2a-backend``), and setting the same-host one up.

``auto`` resolves to ``cuda_ipc`` where every rank is on one CUDA host, steps are bounded
(chunked prefill on) and NVIDIA's ``cuda-bindings`` imports; otherwise to the padded
``all_to_all``. The rule reads only the deployment's config and the installed packages,
so every rank of a host picks the same transport.

The ``cuda_ipc`` buffers are allocated before the rank sizes its KV cache, so they count
as static memory (:mod:`elasticep.engine.limits`), and mapped once the rank is a member:
at launch over the launch cohort; after every membership change over the new members
(:func:`sync_exchange`, called by the step loop at the boundary every rank agreed on).
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import elasticep.distributed as ed
from elasticep.config import A2ABackend, Backend, DeploymentConfig
from elasticep.engine.limits import max_step_tokens
from elasticep.models.config import MoEModelConfig
from elasticep.moe.exchange import stream_memops
from elasticep.moe.exchange.ipc_buffers import capacity_rows
from elasticep.moe.exchange.ipc_exchange import IpcExchange

logger = logging.getLogger(__name__)

STORE_PREFIX = "elasticep-exchange"


def resolve_a2a_backend(d: DeploymentConfig, bindings_available: bool | None = None
                        ) -> A2ABackend:
    """The transport ``d.moe_a2a_backend`` means on this host (``all_to_all`` or
    ``cuda_ipc``).

    Args:
        d: the deployment's config (its own validation already refused cuda_ipc off CUDA,
            across nodes, or without chunked prefill).
        bindings_available: whether ``cuda-bindings`` imports (None: try it).

    Raises:
        ImportError: ``cuda_ipc`` was asked for and ``cuda-bindings`` is missing.
    """
    choice = A2ABackend(d.moe_a2a_backend)
    if choice == A2ABackend.ALL_TO_ALL:
        return choice
    if choice == A2ABackend.AUTO and not (d.device == "cuda" and d.nnodes == 1
                                          and max_step_tokens(d) is not None):
        return A2ABackend.ALL_TO_ALL
    if bindings_available is None:
        bindings_available = stream_memops.available()
    if choice == A2ABackend.CUDA_IPC and not bindings_available:
        stream_memops.driver()  # raises ImportError naming the package
    return A2ABackend.CUDA_IPC if bindings_available else A2ABackend.ALL_TO_ALL


def build_exchange(d: DeploymentConfig, model_config: MoEModelConfig, rank: int,
                   device: torch.device) -> IpcExchange:
    """This rank's ``cuda_ipc`` buffers, sized for the deployment's largest step.

    Raises:
        ValueError: the step is unbounded (chunked prefill off).
    """
    tokens = max_step_tokens(d)
    if tokens is None:
        raise ValueError("--moe-a2a-backend cuda_ipc needs chunked prefill")
    ex = IpcExchange(rank, d.max_ep_size, capacity_rows(tokens, model_config.num_experts_per_tok),
                     model_config.hidden_size, getattr(torch, d.dtype),
                     model_config.num_hidden_layers, device,
                     moe_layers=model_config.moe_layer_ids)
    logger.info("cuda_ipc exchange: %.1f MiB of buffers for steps of up to %d tokens over %d "
                "slots; peer waits %s", ex.nbytes / 2**20, tokens, d.max_ep_size,
                "batched (one graph node per exchange)" if ex.batched_waits else "one by one")
    return ex


def exchange_store(d: DeploymentConfig, timeout_s: float) -> dist.Store | ed.LeaderStore:
    """A client of the deployment's rendezvous TCPStore, under this module's prefix.

    With standby coordinators (``--membership-store etcd://...``, elastic backend) that
    is the current leader's store, followed to each new leader
    (:class:`~elasticep.distributed.LeaderStore`; the caller adds what it publishes to
    its ``republish``): ``d.store_addr`` names the first leader's, gone with it. Needs
    the rank's control connection (``init_process_group``) then.
    """
    if d.elastic_ep_backend == Backend.ELASTIC and d.membership_store.startswith("etcd"):
        store = ed.LeaderStore(lambda: dist.PrefixStore(STORE_PREFIX, ed.store_client()))
        ed.add_leader_listener(store.follow)
        return store
    host, _, port = d.store_addr.rpartition(":")
    store = dist.TCPStore(host, int(port), is_master=False,
                          timeout=timedelta(seconds=timeout_s))
    return dist.PrefixStore(STORE_PREFIX, store)


def sync_exchange(ex: IpcExchange, store: dist.Store | ed.LeaderStore, active: torch.Tensor,
                  timeout_s: float = 60.0) -> None:
    """Bring the exchange to the membership ``active`` ([max_ep_size] bool): map members
    not mapped yet (or relaunched since), unmap ranks that left, then
    :meth:`IpcExchange.reset`. Every member calls it at the same boundary.

    Raises:
        TimeoutError: a member published no buffers within ``timeout_s`` seconds.
    """
    members = [int(r) for r in active.nonzero().flatten().tolist()]
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            mapped = ex.map_peers(store, members)
            break
        except RuntimeError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks {members}: exchange buffers not published in "
                                   f"{timeout_s:.0f} s") from None
            time.sleep(0.01)
    for q in list(ex.peers):
        if q not in members:
            ex.unmap(q)
    if mapped:
        logger.info("cuda_ipc exchange: mapped the buffers of ranks %s", mapped)
    ex.reset(active)
