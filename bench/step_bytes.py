"""The bytes one decode step must read, by part: the numerator of ``bench/scale.py``'s
HBM bound (its module docstring gives the formula).

Pure arithmetic over a model config; an FP8 model (``cfg.quantization``) counts the
weights it holds in FP8 at their FP8 bytes.
"""

from __future__ import annotations

import torch

from elasticep.engine.limits import expert_bytes_per_slot
from elasticep.models import MoEModelConfig
from elasticep.models.quantization import experts_packable


def dense_projections(cfg: MoEModelConfig) -> list[tuple[str, tuple[int, int]]]:
    """Every dense projection a decode step reads once, as (checkpoint weight name,
    ``[out, in]``): attention (or MLA) in every layer, shared experts in MoE layers,
    dense MLPs in the others."""
    H = cfg.hidden_size
    qd, kvd = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    out = []
    for i in range(cfg.num_hidden_layers):
        attn = (cfg.mla.projection_shapes(H) if cfg.mla is not None else
                {"q_proj": (qd, H), "k_proj": (kvd, H), "v_proj": (kvd, H), "o_proj": (H, qd)})
        out += [(f"model.layers.{i}.self_attn.{n}.weight", shape) for n, shape in attn.items()]
        if cfg.moe_layers[i]:
            inter = cfg.shared_expert_intermediate_size
            p = f"model.layers.{i}.mlp." + ("shared_experts" if cfg.mla is not None else "shared_expert")
        else:
            inter, p = cfg.intermediate_size, f"model.layers.{i}.mlp"
        if inter:
            out += [(f"{p}.gate_proj.weight", (inter, H)), (f"{p}.up_proj.weight", (inter, H)),
                    (f"{p}.down_proj.weight", (H, inter))]
    return out


def projection_bytes(cfg: MoEModelConfig, key: str, shape: tuple[int, int], elem: int) -> int:
    """Bytes the model holds for dense projection ``key``: in an FP8 model, 1 a weight
    plus 4 a 128 x 128 block's scale where the format quantizes it (not MLA's ``kv_b``,
    held dequantized: :class:`elasticep.models.mla.MLAWeights`); else ``elem`` a weight."""
    n, k = shape
    q = cfg.quantization
    if q is None or not q.quantizes(key, shape) or key.endswith(".kv_b_proj.weight"):
        return n * k * elem
    return n * k + 4 * -(-n // 128) * -(-k // 128)


def step_bytes(cfg: MoEModelConfig, elem: int, touched_per_layer: list[int],
               ctx_lens: list[int]) -> dict[str, int]:
    """The bytes one decode step must read (see the module docstring), by part.

    An FP8 model (``cfg.quantization``) counts its FP8 weights at 1 byte each plus their
    block scales: the routed experts where they stay FP8 (packed with their scales) and
    the dense projections (:func:`projection_bytes`); the rest (routers, LM head, KV
    cache) count ``elem`` bytes, as they are read."""
    fp8 = cfg.quantization is not None and experts_packable(cfg.hidden_size,
                                                            cfg.moe_intermediate_size)
    n_moe = sum(cfg.moe_layers)
    per_expert = (expert_bytes_per_slot(cfg, torch.bfloat16, fp8=True) // max(n_moe, 1) if fp8
                  else 3 * cfg.hidden_size * cfg.moe_intermediate_size * elem)
    H, D = cfg.hidden_size, cfg.head_dim
    kv_per_token = 2 * cfg.num_key_value_heads * D
    if cfg.mla is not None:  # MLA: the cache holds one latent row
        kv_per_token = cfg.mla.cache_width
    proj = {"attention_weights": 0, "dense_mlps": 0}
    for key, shape in dense_projections(cfg):
        part = "attention_weights" if ".self_attn." in key else "dense_mlps"
        proj[part] += projection_bytes(cfg, key, shape, elem)
    parts = {
        **proj,
        "experts": sum(touched_per_layer) * per_expert,
        "routers": n_moe * cfg.num_experts * H * elem,
        "kv_cache": cfg.num_hidden_layers * sum(ctx_lens) * kv_per_token * elem,
        "lm_head": cfg.vocab_size * H * elem,
    }
    parts["total"] = sum(parts.values())
    return parts
