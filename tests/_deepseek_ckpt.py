"""Tiny seeded DeepSeek-V2/V3 checkpoints for the tests (not a test module).

Built with transformers' own classes and written with ``save_pretrained`` beside the
demo tokenizer. Every variant sets the values that defaults would hide: a random
non-zero ``e_score_correction_bias``, ``routed_scaling_factor`` != 1, ``n_group`` > 1
with ``topk_group`` < ``n_group``, ``first_k_dense_replace`` >= 1, and YaRN.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from elasticep_testkit.paths import DEMO_MODEL

COMMON = dict(
    vocab_size=8192, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
    num_experts_per_tok=3, n_shared_experts=2, kv_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=1, n_group=4, topk_group=2,
    max_position_embeddings=512, bos_token_id=0, eos_token_id=0, pad_token_id=0,
)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1}

VARIANTS = {
    # DeepSeek-V2-Lite's layout: plain q_proj, softmax, greedy (transformers' V2 router
    # ignores norm_topk_prob, as V2-Lite's False does)
    "v2_lite": ("deepseek_v2", dict(q_lora_rank=None, topk_method="greedy", routed_scaling_factor=1.7,
                                    norm_topk_prob=False,
                                    rope_parameters={**YARN, "mscale": 0.707, "mscale_all_dim": 0.707})),
    # DeepSeek-V2: query LoRA and group-limited greedy
    "v2": ("deepseek_v2", dict(q_lora_rank=24, topk_method="group_limited_greedy", routed_scaling_factor=1.5,
                               norm_topk_prob=False,
                               rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 0.8})),
    # DeepSeek-V3: sigmoid, noaux_tc with a correction bias, renormalised top-k
    "v3": ("deepseek_v3", dict(q_lora_rank=24, routed_scaling_factor=2.5, norm_topk_prob=True,
                               rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0})),
}


def build(variant: str, out: Path, seed: int = 0, **overrides):
    """Write checkpoint ``variant`` of :data:`VARIANTS` to ``out`` (``overrides`` replace
    config values); return the HF model (eval, fp32)."""
    import transformers as tf

    family, extra = VARIANTS[variant]
    cls_cfg, cls_model = ((tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM) if family == "deepseek_v2"
                          else (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM))
    torch.manual_seed(seed)
    model = cls_model(cls_cfg(**{**COMMON, **extra, **overrides})).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        # transformers' init leaves routers, norms and the bias at 0/1: spread everything
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.08 * noise)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=gen))
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_MODEL / f, out / f)
    return model
