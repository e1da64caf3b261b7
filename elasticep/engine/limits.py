"""A rank's limits (KV tokens, running requests, captured batch, prefill chunk), sized
like SGLang's.

Two kinds of limit, kept apart on purpose:

* **The exchange's shape is the deployment's.** The decode CUDA graphs are captured
  for the buckets up to :func:`cuda_graph_max_bs`, and the EP exchange of a step is
  rounded up to those buckets. Every rank must derive the same list, so it is a pure
  function of :class:`~elasticep.config.DeploymentConfig` alone: a relaunched rank and a
  scale joiner read that config from the coordinator and get the same buckets.
* **What a rank can hold is its own.** On CUDA, ``--mem-fraction-static`` (SGLang's
  meaning: the fraction of a GPU's memory for weights and KV cache; the rest stays free
  for activations, CUDA graphs and exchange buffers) sizes a rank's KV cache from its
  GPU, after its weights are loaded; ranks that share a GPU (rank ``r`` uses GPU
  ``r % gpu_count``) split it. ``--max-running-requests`` defaults to what that KV cache
  holds. These may differ between ranks (a joiner may share a GPU that launch ranks
  did not); they never change the exchange (each step agrees on its own token bound in
  the step header), and each rank reports them in its hello, so the front-end routes
  no more requests to a rank than that rank's ``max_running_requests``.

The arithmetic is pure and tested on CPU with real numbers; :func:`measure_rank_limits`
is the thin part that reads the GPU.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from elasticep.config import DeploymentConfig
from elasticep.engine.cuda_graph import DEFAULT_BUCKETS
from elasticep.engine.llm_engine import EngineConfig
from elasticep.models.config import MoEModelConfig
from elasticep.models.model import kv_cache_shapes
from elasticep.models.quantization import experts_packable
from elasticep.moe.experts import fp8_block

logger = logging.getLogger(__name__)

CPU_MAX_TOTAL_TOKENS = 8192  # KV tokens per rank on CPU, where nothing is sized from memory
CPU_MAX_RUNNING_REQUESTS = 64
# SGLang's default fraction is picked per GPU size; 0.85 leaves ~21 GiB of an H200 for
# activations (a chunked prefill of 8192 tokens), CUDA graphs and exchange buffers.
DEFAULT_MEM_FRACTION_STATIC = 0.85
# CUDA's default --max-running-requests: the KV tokens over this reservation per
# request (a 256-token prompt with its first outputs), at most MAX_RUNNING_REQUESTS_CAP.
KV_TOKENS_PER_REQUEST = 256
MAX_RUNNING_REQUESTS_CAP = 1024
DEFAULT_CUDA_GRAPH_MAX_BS = DEFAULT_BUCKETS[-1]  # 256
DEFAULT_CHUNKED_PREFILL_SIZE = 8192  # CUDA; CPU: no chunking, as before the flag
# a step's tokens when --max-num-batched-tokens is not given: at least this, and at
# least the chunk (a smaller budget would only shrink the chunk)
DEFAULT_MAX_NUM_BATCHED_TOKENS = EngineConfig.max_batch_tokens


@dataclass(frozen=True)
class RankLimits:
    """The limits one rank runs with.

    Attributes:
        max_total_tokens: KV-cache capacity in tokens (whole blocks).
        max_running_requests: most sequences in one step of this rank.
        cuda_graph_max_bs: largest decode batch captured in a CUDA graph; the same on
            every rank (:func:`cuda_graph_max_bs`).
        chunked_prefill_size: most prefill tokens per step, None: no chunking.
        max_num_batched_tokens: most tokens per step, decodes included
            (:mod:`elasticep.engine.admission`); None: :func:`max_num_batched_tokens`'s
            default for the chunk.
    """

    max_total_tokens: int
    max_running_requests: int
    cuda_graph_max_bs: int
    chunked_prefill_size: int | None
    max_num_batched_tokens: int | None = None

    def engine_config(self, **kw: object) -> EngineConfig:
        """The engine's config with these limits (``kw``: its other fields).

        With chunking on, a step admits up to ``chunked_prefill_size`` prefill tokens
        (SGLang's meaning of the flag), within the step's budget.
        """
        budget = self.max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS,
                                                    self.chunked_prefill_size or 0)
        return EngineConfig(max_total_tokens=self.max_total_tokens,
                            max_num_seqs=self.max_running_requests,
                            cuda_graph_max_bs=self.cuda_graph_max_bs,
                            chunked_prefill_size=self.chunked_prefill_size,
                            max_batch_tokens=budget, **kw)


def kv_bytes_per_token(config: MoEModelConfig, dtype: torch.dtype) -> int:
    """Bytes of KV cache one token takes over all layers (pure).

    The tensors of :func:`~elasticep.models.model.kv_cache_shapes` in every layer: GQA
    caches K and V, ``2 * num_key_value_heads * head_dim`` values a layer; MLA one
    latent row of ``kv_lora_rank + qk_rope_head_dim`` values.
    """
    per_layer = sum(math.prod(shape) for shape in kv_cache_shapes(config))
    return config.num_hidden_layers * per_layer * torch.empty((), dtype=dtype).element_size()


def expert_bytes_per_slot(config: MoEModelConfig, dtype: torch.dtype, fp8: bool = False) -> int:
    """Bytes of one physical expert slot over all MoE layers: gate, up and down
    projections, ``3 * hidden_size * moe_intermediate_size`` values a layer (pure); with
    ``fp8``, the packed FP8 slot's bytes (1 a weight plus the block scales,
    :func:`~elasticep.moe.experts.fp8_block.packed_rows`)."""
    hid, inter = config.hidden_size, config.moe_intermediate_size
    if fp8:
        per_layer = (fp8_block.packed_rows(2 * inter, hid) * hid
                     + fp8_block.packed_rows(hid, inter) * inter)
        return len(config.moe_layer_ids) * per_layer
    n = len(config.moe_layer_ids) * 3 * hid * inter
    return n * torch.empty((), dtype=dtype).element_size()


def experts_stored_fp8(d: DeploymentConfig, config: MoEModelConfig) -> bool:
    """Whether this deployment's ranks hold their experts as packed FP8 slots (pure):
    an FP8 checkpoint or ``--quantization fp8``, on a shape that packs."""
    return ((config.quantization is not None or d.quantization == "fp8")
            and experts_packable(config.hidden_size, config.moe_intermediate_size))


def ranks_sharing_gpu(rank: int, max_ep_size: int, gpu_count: int) -> int:
    """How many of the deployment's slots (``0..max_ep_size-1``, scale-up capacity
    included, so a later joiner finds its share free) use the GPU of ``rank``, where slot
    ``r`` uses GPU ``r % gpu_count`` (pure).

    Raises:
        ValueError: ``gpu_count < 1`` or ``rank`` outside the slots.
    """
    if gpu_count < 1 or not 0 <= rank < max_ep_size:
        raise ValueError(f"rank {rank} of {max_ep_size} slots on {gpu_count} GPUs")
    return len(range(rank % gpu_count, max_ep_size, gpu_count))


def kv_tokens_for_memory(gpu_total_bytes: int, mem_fraction_static: float,
                         ranks_on_gpu: int, weight_bytes: int, kv_bytes_per_token: int,
                         block_size: int = 16) -> int:
    """KV tokens of one rank: its share of the GPU's static memory, less its weights
    (pure).

    Args:
        gpu_total_bytes: the GPU's memory (``torch.cuda.mem_get_info()[1]``), bytes.
        mem_fraction_static: the fraction for weights and KV cache, in (0, 1).
        ranks_on_gpu: ranks splitting that fraction (:func:`ranks_sharing_gpu`).
        weight_bytes: this rank's weights (and other static tensors), bytes.
        kv_bytes_per_token: :func:`kv_bytes_per_token`.
        block_size: tokens per KV block; the result is whole blocks, less the one
            block the CUDA graphs use as their sink.

    Returns:
        Tokens, a multiple of ``block_size``, >= ``block_size``.

    Raises:
        ValueError: the share does not hold the weights and one block, naming
            ``--mem-fraction-static`` and the numbers.
    """
    share = int(gpu_total_bytes * mem_fraction_static) // ranks_on_gpu
    blocks = (share - weight_bytes) // (kv_bytes_per_token * block_size) - 1
    if blocks < 1:
        mib = 1 << 20
        raise ValueError(
            f"--mem-fraction-static {mem_fraction_static:g}: this rank's share, "
            f"{share // mib} MiB ({ranks_on_gpu} rank(s) on a {gpu_total_bytes // mib} MiB "
            f"GPU), does not hold its {weight_bytes // mib} MiB of weights and a KV cache; "
            "raise it, or use more GPUs")
    return blocks * block_size


def default_max_running_requests(device: str, max_total_tokens: int) -> int:
    """``--max-running-requests`` when not given (pure): on CUDA the KV tokens over
    :data:`KV_TOKENS_PER_REQUEST`, between 1 and :data:`MAX_RUNNING_REQUESTS_CAP`; on CPU
    :data:`CPU_MAX_RUNNING_REQUESTS`."""
    if device != "cuda":
        return CPU_MAX_RUNNING_REQUESTS
    return max(1, min(MAX_RUNNING_REQUESTS_CAP, max_total_tokens // KV_TOKENS_PER_REQUEST))


def cuda_graph_max_bs(d: DeploymentConfig) -> int:
    """The largest captured decode batch: ``--cuda-graph-max-bs`` (no larger than
    ``--max-running-requests`` where that is given: no decode batch is bigger), else the
    smaller of ``--max-running-requests`` (where given) and
    :data:`DEFAULT_CUDA_GRAPH_MAX_BS`.

    A function of the deployment's config only (pure), never of a rank's GPU: every
    rank, joiners included, derives the same buckets and so the same exchange sizes.
    """
    if d.cuda_graph_max_bs is not None:
        return min(d.cuda_graph_max_bs, d.max_running_requests or d.cuda_graph_max_bs)
    if d.max_running_requests is not None:
        return min(d.max_running_requests, DEFAULT_CUDA_GRAPH_MAX_BS)
    return DEFAULT_CUDA_GRAPH_MAX_BS


def resolve_chunk(flag: int | None, device: str) -> int | None:
    """The engine's prefill chunk for a ``--chunked-prefill-size`` value (pure): -1 is
    None (off); unset is :data:`DEFAULT_CHUNKED_PREFILL_SIZE` on CUDA and None on CPU."""
    if flag is None:
        return DEFAULT_CHUNKED_PREFILL_SIZE if device == "cuda" else None
    return None if flag == -1 else flag


def chunked_prefill_size(d: DeploymentConfig) -> int | None:
    """The engine's prefill chunk of a deployment (:func:`resolve_chunk`)."""
    return resolve_chunk(d.chunked_prefill_size, d.device)


def max_step_tokens(d: DeploymentConfig) -> int | None:
    """The most tokens one step of any rank can forward (pure), which sizes the
    same-host exchange's buffers; None where it is unbounded (chunked prefill off: one
    prompt may fill a step).

    With chunking, the scheduler admits prefill tokens within the step's budget
    (``--max-num-batched-tokens``) and runs at most ``max_running_requests`` decodes,
    so a step holds at most the larger of the two (by default, with the chunk size
    too, to be safe against a larger budget).
    """
    chunk = chunked_prefill_size(d)
    if chunk is None:
        return None
    running = d.max_running_requests or MAX_RUNNING_REQUESTS_CAP
    if d.max_num_batched_tokens is not None:  # prefill never takes a step past it
        return max(d.max_num_batched_tokens, running)
    return max(DEFAULT_MAX_NUM_BATCHED_TOKENS, chunk, running)


def known_max_total_tokens(d: DeploymentConfig) -> int | None:
    """The KV tokens per rank known before any rank loads (pure): ``--max-total-tokens``,
    else the CPU default; None on CUDA, where each rank sizes its own."""
    if d.max_total_tokens is not None:
        return d.max_total_tokens
    return None if d.device == "cuda" else CPU_MAX_TOTAL_TOKENS


def rank_limits(d: DeploymentConfig, kv_tokens: int | None) -> RankLimits:
    """A rank's limits from the config and, where the config does not fix it, the KV
    tokens its memory holds (pure).

    Args:
        d: the deployment's config.
        kv_tokens: :func:`kv_tokens_for_memory` on CUDA; None on CPU (or where
            ``--max-total-tokens`` is given, which overrides it).
    """
    total = d.max_total_tokens or kv_tokens or CPU_MAX_TOTAL_TOKENS
    running = d.max_running_requests or default_max_running_requests(d.device, total)
    return RankLimits(total, running, cuda_graph_max_bs(d), chunked_prefill_size(d),
                      d.max_num_batched_tokens)


@dataclass(frozen=True)
class GpuMemory:
    """What a rank measured of its GPU after loading its weights (bytes).

    Attributes:
        total_bytes: the GPU's memory (``torch.cuda.mem_get_info()[1]``).
        allocated_bytes: what this process allocated (``torch.cuda.memory_allocated``).
        gpu_count: GPUs this process sees (``torch.cuda.device_count()``).
    """

    total_bytes: int
    allocated_bytes: int
    gpu_count: int


def kv_tokens_of_rank(d: DeploymentConfig, model_config: MoEModelConfig, rank: int,
                      memory: GpuMemory, missing_expert_slots: int = 0,
                      block_size: int = 16) -> int:
    """The KV tokens of ``rank`` from what it measured (pure).

    Its weights are what it allocated plus the expert slots it will still receive (a
    joiner loads none; its peers send them once it is admitted), so a joiner and a
    launch rank of the same placement get the same share.

    Raises:
        ValueError: the share is too small (:func:`kv_tokens_for_memory`).
    """
    dtype = getattr(torch, d.dtype)
    weights = (memory.allocated_bytes
               + missing_expert_slots * expert_bytes_per_slot(
                   model_config, dtype, experts_stored_fp8(d, model_config)))
    return kv_tokens_for_memory(
        memory.total_bytes, d.mem_fraction_static or DEFAULT_MEM_FRACTION_STATIC,
        ranks_sharing_gpu(rank, d.max_ep_size, memory.gpu_count), weights,
        kv_bytes_per_token(model_config, dtype), block_size)


def measure_rank_limits(d: DeploymentConfig, model_config: MoEModelConfig, rank: int,
                        missing_expert_slots: int = 0, block_size: int = 16) -> RankLimits:
    """:func:`rank_limits` of this process, after its weights are loaded on its device.

    On CUDA without ``--max-total-tokens`` the KV cache is sized from the current GPU
    (:func:`kv_tokens_of_rank` over :class:`GpuMemory` read now).

    Args:
        d: the deployment's config.
        model_config: the model's config.
        rank: this rank's slot.
        missing_expert_slots: local expert slots per layer not loaded yet.
        block_size: tokens per KV block.

    Raises:
        ValueError: the GPU share is too small (:func:`kv_tokens_for_memory`).
    """
    kv_tokens = None
    if d.device == "cuda" and d.max_total_tokens is None:
        torch.cuda.synchronize()
        memory = GpuMemory(torch.cuda.mem_get_info()[1], torch.cuda.memory_allocated(),
                           torch.cuda.device_count())
        kv_tokens = kv_tokens_of_rank(d, model_config, rank, memory, missing_expert_slots,
                                      block_size)
        logger.info("KV cache sized from GPU memory: %s, fraction %s, %d expert slots to "
                    "come -> %d tokens", memory, d.mem_fraction_static or
                    DEFAULT_MEM_FRACTION_STATIC, missing_expert_slots, kv_tokens)
    return rank_limits(d, kv_tokens)

