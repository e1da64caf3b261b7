"""Parse a Hugging Face MoE ``config.json`` into one frozen, family-neutral config.

transformers is used only to read and default the config (``AutoConfig``); the fields
the forward pass needs are copied into :class:`MoEModelConfig`, reading both key
spellings where the families differ (``num_experts`` / ``num_local_experts``,
``rope_theta`` / ``rope_parameters["rope_theta"]``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")


def unsupported(problem: str) -> ValueError:
    """Build the one-line error every loader failure uses; it names the supported families."""
    return ValueError(f"{problem} (supported model families: {', '.join(SUPPORTED_FAMILIES)})")


@dataclass(frozen=True)
class MoEModelConfig:
    """What our forward pass needs to know about a checkpoint.

    Attributes:
        model_type: one of :data:`SUPPORTED_FAMILIES`.
        moe_layers: per decoder layer, True when it is a sparse MoE layer (False = dense MLP).
        moe_intermediate_size: I, the width of one routed expert.
        intermediate_size: width of the dense MLP used by non-MoE layers.
        shared_expert_intermediate_size: width of qwen2_moe's shared expert, 0 if none.
        qk_norm: per-head RMSNorm on q and k (qwen3_moe).
        qkv_bias / o_bias: biases on the q/k/v and o projections.
        norm_topk_prob: renormalise the top-k softmax weights to sum to 1.
        eos_token_ids: token ids that end generation.
        attention_window: sliding-window size, or None. We implement full attention only,
            so the engine caps sequences at this length (where the two agree).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    qk_norm: bool
    qkv_bias: bool
    o_bias: bool
    moe_layers: tuple[bool, ...]
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    attention_window: int | None = None

    @property
    def moe_layer_ids(self) -> list[int]:
        """Indices of the decoder layers that hold routed experts."""
        return [i for i, is_moe in enumerate(self.moe_layers) if is_moe]


def _first(cfg: Any, raw: dict, *names: str, default: Any = None) -> Any:
    """Return the first non-None value among ``names`` in the HF config or the raw JSON."""
    for name in names:
        value = getattr(cfg, name, None)
        if value is None:
            value = raw.get(name)
        if value is not None:
            return value
    return default


def _rope_theta(cfg: Any, raw: dict) -> float:
    """Read RoPE theta from ``rope_parameters`` (transformers 5) or ``rope_theta`` (4.x)."""
    params = getattr(cfg, "rope_parameters", None) or raw.get("rope_parameters") or {}
    rope_type = params.get("rope_type", params.get("type", "default")) if params else "default"
    if rope_type not in ("default", None):
        raise unsupported(f"rope_type {rope_type!r} is not supported, only 'default'")
    theta = params.get("rope_theta") if params else None
    if theta is None:
        theta = _first(cfg, raw, "rope_theta")
    if theta is None:
        raise unsupported("config has neither rope_parameters.rope_theta nor rope_theta")
    return float(theta)


def load_model_config(model_dir: str | Path) -> MoEModelConfig:
    """Read ``model_dir/config.json`` into a :class:`MoEModelConfig`.

    Raises:
        ValueError: no config.json, or an unsupported ``model_type`` / attention variant.
    """
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise unsupported(f"no config.json in {model_dir}")
    raw = json.loads(path.read_text())
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_FAMILIES:
        raise unsupported(f"unsupported model_type {model_type!r} in {path}")
    from transformers import AutoConfig  # lazy: only configs come from transformers

    cfg = AutoConfig.from_pretrained(str(model_dir))
    n_layers = int(cfg.num_hidden_layers)
    n_heads = int(cfg.num_attention_heads)
    hidden = int(cfg.hidden_size)
    num_experts = int(_first(cfg, raw, "num_experts", "num_local_experts", default=0))
    if num_experts <= 0:
        raise unsupported(f"{path} declares no experts (num_experts / num_local_experts)")
    window = None
    if model_type == "mixtral" or _first(cfg, raw, "use_sliding_window", default=False):
        window = _first(cfg, raw, "sliding_window", default=None) or None
    act = _first(cfg, raw, "hidden_act", default="silu")
    if act != "silu":
        raise unsupported(f"hidden_act {act!r} is not supported, only 'silu'")

    if model_type == "mixtral":
        moe_layers = tuple(True for _ in range(n_layers))
        moe_inter = int(cfg.intermediate_size)
        norm_topk = True  # mixtral's softmax over the top-k logits == renormalised top-k
        qkv_bias = o_bias = False
        shared = 0
    else:
        step = int(_first(cfg, raw, "decoder_sparse_step", default=1))
        dense = set(_first(cfg, raw, "mlp_only_layers", default=[]) or [])
        moe_layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(n_layers))
        moe_inter = int(cfg.moe_intermediate_size)
        norm_topk = bool(_first(cfg, raw, "norm_topk_prob", default=False))
        if model_type == "qwen2_moe":
            # transformers 5 names it qkv_bias; 4.x always had q/k/v biases
            qkv_bias, o_bias = bool(_first(cfg, raw, "qkv_bias", default=True)), False
            shared = int(_first(cfg, raw, "shared_expert_intermediate_size", default=0))
        else:
            qkv_bias = o_bias = bool(_first(cfg, raw, "attention_bias", default=False))
            shared = 0

    eos = _first(cfg, raw, "eos_token_id", default=[])
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    return MoEModelConfig(
        model_type=model_type,
        vocab_size=int(cfg.vocab_size),
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=int(_first(cfg, raw, "num_key_value_heads", default=n_heads)),
        head_dim=int(_first(cfg, raw, "head_dim", default=hidden // n_heads)),
        rms_norm_eps=float(cfg.rms_norm_eps),
        rope_theta=_rope_theta(cfg, raw),
        max_position_embeddings=int(cfg.max_position_embeddings),
        num_experts=num_experts,
        num_experts_per_tok=int(cfg.num_experts_per_tok),
        moe_intermediate_size=moe_inter,
        intermediate_size=int(_first(cfg, raw, "intermediate_size", default=moe_inter)),
        shared_expert_intermediate_size=shared,
        norm_topk_prob=norm_topk,
        qk_norm=model_type == "qwen3_moe",
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        moe_layers=moe_layers,
        tie_word_embeddings=bool(_first(cfg, raw, "tie_word_embeddings", default=False)),
        eos_token_ids=tuple(int(e) for e in eos_ids),
        attention_window=int(window) if window else None,
    )
