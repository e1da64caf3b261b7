"""HF MoE families (qwen3_moe, qwen2_moe, mixtral, deepseek_v2, deepseek_v3) with our own
forward pass, and the per-rank safetensors loader."""

from elasticep.models.config import SUPPORTED_FAMILIES, MoEModelConfig, load_model_config
from elasticep.models.expert_loader import load_expert_into_slot
from elasticep.models.loader import load_model, reload_expert
from elasticep.models.model import MoECausalLM

__all__ = [
    "SUPPORTED_FAMILIES",
    "MoECausalLM",
    "MoEModelConfig",
    "load_expert_into_slot",
    "load_model",
    "load_model_config",
    "reload_expert",
]
