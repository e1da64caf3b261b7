"""Whether a deployment's ranks can fit their GPUs, checked before any rank loads (pure).

A rank sizes its KV cache after loading its weights (:mod:`.limits`); a share that
cannot hold the weights was found only then, after minutes of loading. Here the same
rules run first, on the GPU's size and a lower bound of a rank's weights computed from
the model's config, so ``serve`` refuses such a start-up at once, in one line with the
numbers (exit status 2).
"""

from __future__ import annotations

import torch

from elasticep.config import DeploymentConfig
from elasticep.engine.limits import (
    DEFAULT_MEM_FRACTION_STATIC,
    expert_bytes_per_slot,
    kv_bytes_per_token,
    ranks_sharing_gpu,
)
from elasticep.models.config import MoEModelConfig


def weight_bytes_lower_bound(config: MoEModelConfig, dtype: torch.dtype,
                             slots_per_rank: int) -> int:
    """Bytes one rank's weights take at least, before loading any (pure): its expert
    slots (reserved ones included) over all MoE layers, the embedding and LM head, the
    routers, shared experts and dense MLPs, and GQA attention's projections (MLA's
    are left out, so it stays a lower bound; norms and biases too).

    Args:
        config: the model's config.
        dtype: the weights' dtype.
        slots_per_rank: physical expert slots per MoE layer of the rank.
    """
    h, moe = config.hidden_size, len(config.moe_layer_ids)
    dense = config.num_hidden_layers - moe
    n = config.vocab_size * h * (1 if config.tie_word_embeddings else 2)
    n += moe * (config.num_experts * h + 3 * h * config.shared_expert_intermediate_size)
    n += dense * 3 * h * config.intermediate_size
    if config.mla is None:
        q = config.num_attention_heads * config.head_dim
        kv = config.num_key_value_heads * config.head_dim
        n += config.num_hidden_layers * (2 * h * q + 2 * h * kv)
    elem = torch.empty((), dtype=dtype).element_size()
    return n * elem + slots_per_rank * expert_bytes_per_slot(config, dtype)


def startup_fit_problem(gpu_total_bytes: int, mem_fraction_static: float, ranks_on_gpu: int,
                        launch_ranks_on_gpu: int, weight_bytes: int, kv_tokens: int | None,
                        kv_bytes_per_token: int, block_size: int = 16) -> str | None:
    """Why the ranks of one GPU cannot fit their weights and KV caches, in one line with
    the numbers, or None where they may (pure). A rank's own rules, applied before
    loading with a lower bound of its weights, so that a start-up that cannot fit says
    so at once instead of after minutes of loading:

    * KV cache sized from memory (``kv_tokens`` None): a rank's share of the GPU,
      ``mem_fraction_static`` of it over every slot on it (``--max-ep-size`` capacity
      included), must hold its weights and a KV cache of one block beside the CUDA
      graphs' sink block (:func:`~elasticep.engine.limits.kv_tokens_for_memory`).
    * A fixed KV cache (``--max-total-tokens``): the ranks launched on the GPU must
      hold their weights and those caches (and the sink blocks) in the whole GPU.

    Args:
        gpu_total_bytes: the GPU's memory, bytes.
        mem_fraction_static: the fraction for weights and KV cache.
        ranks_on_gpu: the deployment's slots on that GPU (:func:`~elasticep.engine.limits.ranks_sharing_gpu`
            over ``--max-ep-size``).
        launch_ranks_on_gpu: the ranks launched on it (over ``--ep-size``).
        weight_bytes: :func:`weight_bytes_lower_bound` of one rank.
        kv_tokens: ``--max-total-tokens``, or None.
        kv_bytes_per_token: :func:`kv_bytes_per_token`.
        block_size: tokens per KV block.
    """
    gib = float(1 << 30)
    if kv_tokens is None:
        share = int(gpu_total_bytes * mem_fraction_static) // ranks_on_gpu
        need = weight_bytes + 2 * block_size * kv_bytes_per_token
        if need <= share:
            return None
        return (f"a rank's weights need at least {weight_bytes / gib:.1f} GiB (reserved "
                f"expert slots included) but its share of its GPU is {share / gib:.1f} GiB "
                f"({mem_fraction_static:g} of {gpu_total_bytes / gib:.1f} GiB over "
                f"{ranks_on_gpu} slot(s) on that GPU, --max-ep-size capacity included), "
                "leaving no KV cache; use more GPUs, a smaller --max-ep-size, a larger "
                "--min-ep-size (fewer reserved slots), "
                "a larger --mem-fraction-static, or size the cache with --max-total-tokens")
    kv = (-(-kv_tokens // block_size) + 1) * block_size * kv_bytes_per_token
    need = launch_ranks_on_gpu * (weight_bytes + kv)
    if need <= gpu_total_bytes:
        return None
    return (f"{launch_ranks_on_gpu} rank(s) on one GPU need {need / gib:.1f} GiB (each at "
            f"least {weight_bytes / gib:.1f} GiB of weights, reserved expert slots included, "
            f"and {kv / gib:.1f} GiB of KV cache for --max-total-tokens {kv_tokens}) but the "
            f"GPU has {gpu_total_bytes / gib:.1f} GiB; use more GPUs, fewer "
            "--max-total-tokens, or a larger --min-ep-size")


def deployment_fit_problem(d: DeploymentConfig, model_config: MoEModelConfig,
                           slots_per_rank: int, gpu_total_bytes: int, gpu_count: int,
                           ) -> str | None:
    """:func:`startup_fit_problem` of the deployment's fullest GPU, GPU 0 (slot 0's: it
    holds ``ceil(slots / gpu_count)``), on CUDA; None on CPU (pure).

    Args:
        d: the deployment's config.
        model_config: the model's config.
        slots_per_rank: expert slots per MoE layer of a launch rank (reserved included).
        gpu_total_bytes: the memory of one GPU, bytes.
        gpu_count: GPUs the ranks use.
    """
    if d.device != "cuda":
        return None
    dtype = getattr(torch, d.dtype)
    return startup_fit_problem(
        gpu_total_bytes, d.mem_fraction_static or DEFAULT_MEM_FRACTION_STATIC,
        ranks_sharing_gpu(0, d.max_ep_size, gpu_count),
        ranks_sharing_gpu(0, d.ep_size, gpu_count),
        weight_bytes_lower_bound(model_config, dtype, slots_per_rank),
        d.max_total_tokens, kv_bytes_per_token(model_config, dtype))
