"""Parse a Hugging Face MoE ``config.json`` into one frozen, family-neutral config.

transformers is used only to read and default the config (``AutoConfig``); the fields
the forward pass needs are copied into :class:`MoEModelConfig`, reading both key
spellings where the families differ (``num_experts`` / ``num_local_experts`` /
``n_routed_experts``, ``rope_scaling`` / ``rope_parameters``).

Importing transformers costs a process about 1.5 s of CPU, and every rank of every
deployment parses the config. So the attributes that parsing read from ``AutoConfig``
are recorded in a small JSON file per (``config.json`` bytes, transformers version)
(:mod:`elasticep.models.config_cache`), and a later process replays them instead of importing
transformers: the same values, read in the same order, give the same config.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elasticep.models.config_cache import NotRecorded, Recorder, Replay, cache_file
from elasticep.models.mla import MLAConfig
from elasticep.models.quantization import Fp8BlockQuantization, parse_quantization
from elasticep.models.rope import RopeConfig, parse_rope
from elasticep.models.routing import RoutingConfig

SUPPORTED_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v2", "deepseek_v3")
DEEPSEEK_FAMILIES = ("deepseek_v2", "deepseek_v3")


def unsupported(problem: str) -> ValueError:
    """Build the one-line error every loader failure uses; it names the supported families."""
    return ValueError(f"{problem} (supported model families: {', '.join(SUPPORTED_FAMILIES)})")


@dataclass(frozen=True)
class SamplingDefaults:
    """The sampling settings a checkpoint's ``generation_config.json`` sets, used where an
    API request leaves them unset (what vLLM and SGLang do by default). None: the file does
    not set it. ``do_sample`` is not read: an API client that sends no temperature asks
    for sampling, whatever ``generate``'s greedy default.

    Attributes:
        temperature: softmax temperature (>= 0; 0 is greedy).
        top_p: nucleus mass in (0, 1].
        top_k: the most likely tokens kept (>= 0; 0 disables it).
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None


@dataclass(frozen=True)
class MoEModelConfig:
    """What our forward pass needs to know about a checkpoint.

    Attributes:
        model_type: one of :data:`SUPPORTED_FAMILIES`.
        moe_layers: per decoder layer, True when it is a sparse MoE layer (False = dense MLP).
        moe_intermediate_size: I, the width of one routed expert.
        intermediate_size: width of the dense MLP used by non-MoE layers.
        shared_expert_intermediate_size: width of the shared expert MLP (qwen2_moe's
            ``shared_expert``, DeepSeek's ``shared_experts``: I x n_shared_experts), 0 if none.
        qk_norm: per-head RMSNorm on q and k (qwen3_moe).
        qkv_bias / o_bias: biases on the q/k/v and o projections.
        routing: how MoE layers pick experts (softmax top-k, or DeepSeek's grouped rules).
        rope: RoPE variant and scaling.
        mla: Multi-head Latent Attention sizes (DeepSeek), or None for GQA attention.
        eos_token_ids: token ids that end generation: ``generation_config.json``'s when it
            sets them (what transformers' ``generate`` stops on), else ``config.json``'s.
        sampling_defaults: ``generation_config.json``'s temperature, top_p and top_k.
        attention_window: sliding-window size, or None. We implement full attention only,
            so the engine caps sequences at this length (where the two agree).
        quantization: the checkpoint's stored quantization (block FP8), or None for an
            unquantized one (``--quantization fp8`` is the deployment's, not this).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    num_experts: int
    moe_intermediate_size: int
    intermediate_size: int
    shared_expert_intermediate_size: int
    routing: RoutingConfig
    qk_norm: bool
    qkv_bias: bool
    o_bias: bool
    moe_layers: tuple[bool, ...]
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    attention_window: int | None = None
    mla: MLAConfig | None = None
    sampling_defaults: SamplingDefaults = SamplingDefaults()
    quantization: Fp8BlockQuantization | None = None

    @property
    def rope_dim(self) -> int:
        """Width of the rotated part of each query/key head."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    @property
    def num_experts_per_tok(self) -> int:
        """k, the routed experts per token."""
        return self.routing.top_k

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


def _rope(cfg: Any, raw: dict) -> RopeConfig:
    """RoPE settings from the raw JSON (either spelling), else from transformers' defaults.

    Called once before transformers sees the config (``cfg`` None: its own validation
    would raise a multi-line KeyError for a type we refuse anyway), and once after.

    Raises:
        ValueError: an unsupported rope type, as a one-line error naming the families.
    """
    source = raw
    if not any(k in raw for k in ("rope_parameters", "rope_scaling", "rope_theta")):
        source = {"rope_parameters": getattr(cfg, "rope_parameters", None)}
    max_pos = raw.get("max_position_embeddings") or getattr(cfg, "max_position_embeddings", 2048)
    try:
        return parse_rope(source, int(max_pos))
    except ValueError as e:
        raise unsupported(str(e)) from None


def _deepseek_parts(
    cfg: Any, raw: dict, n_layers: int, num_experts: int, top_k: int
) -> tuple[tuple[bool, ...], RoutingConfig, int, MLAConfig]:
    """DeepSeek-V2/V3: dense-layer pattern, grouped routing, shared experts and MLA sizes.

    Layer i is MoE when ``i >= first_k_dense_replace`` and ``i % moe_layer_freq == 0``
    (DeepSeek's own modeling code). V3 scores with a sigmoid and ``noaux_tc`` unless the
    config says otherwise.
    """
    is_v3 = raw.get("model_type") == "deepseek_v3"
    first_dense = int(_first(cfg, raw, "first_k_dense_replace", default=0))
    freq = int(_first(cfg, raw, "moe_layer_freq", default=1))
    moe_layers = tuple(i >= first_dense and i % freq == 0 for i in range(n_layers))
    routing = RoutingConfig(
        num_experts=num_experts,
        top_k=top_k,
        scoring_func=str(_first(cfg, raw, "scoring_func", default="sigmoid" if is_v3 else "softmax")),
        topk_method=str(_first(cfg, raw, "topk_method", default="noaux_tc" if is_v3 else "greedy")),
        n_group=int(_first(cfg, raw, "n_group", default=1)),
        topk_group=int(_first(cfg, raw, "topk_group", default=1)),
        norm_topk_prob=bool(_first(cfg, raw, "norm_topk_prob", default=False)),
        routed_scaling_factor=float(_first(cfg, raw, "routed_scaling_factor", default=1.0)),
        fp32_logits=True,
    )
    if _first(cfg, raw, "attention_bias", default=False):
        raise unsupported("attention_bias is not supported for deepseek models")
    q_lora = _first(cfg, raw, "q_lora_rank", default=None)
    mla = MLAConfig(
        num_heads=int(cfg.num_attention_heads),
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=int(cfg.kv_lora_rank),
        qk_nope_head_dim=int(cfg.qk_nope_head_dim),
        qk_rope_head_dim=int(cfg.qk_rope_head_dim),
        v_head_dim=int(cfg.v_head_dim),
        # V2 always rotates interleaved pairs; V3 says so in rope_interleave
        rope_interleave=bool(_first(cfg, raw, "rope_interleave", default=True)) if is_v3 else True,
    )
    shared = int(_first(cfg, raw, "n_shared_experts", default=0) or 0) * int(cfg.moe_intermediate_size)
    return moe_layers, routing, shared, mla


def _generation_config(model_dir: Path) -> dict:
    """``generation_config.json`` (transformers' generation defaults), or {} if absent.

    Raises:
        ValueError: the file exists but is not a JSON object.
    """
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise unsupported(f"{path} is not JSON ({exc.msg})") from None
    if not isinstance(data, dict):
        raise unsupported(f"{path} is not a JSON object")
    return data


def _sampling_defaults(gen: dict, path: Path) -> SamplingDefaults:
    """The sampling keys of a parsed ``generation_config.json`` (``path``, for errors).

    Raises:
        ValueError: a value of the wrong type or out of range, naming the key and file.
    """
    def number(key: str, ok: Any, want: str, kind: type = float) -> Any:
        value = gen.get(key)
        if value is None:
            return None
        if (isinstance(value, bool) or not isinstance(value, int | float)
                or (kind is int and not isinstance(value, int)) or not ok(value)):
            raise ValueError(f"{path}: {key} must be {want}, got {value!r}")
        return kind(value)

    return SamplingDefaults(
        temperature=number("temperature", lambda v: v >= 0, "a number >= 0"),
        top_p=number("top_p", lambda v: 0 < v <= 1, "a number in (0, 1]"),
        top_k=number("top_k", lambda v: v >= 0, "an integer >= 0", int))


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
    _rope(None, raw)
    cache = cache_file(path)
    replay = Replay.load(cache)
    if replay is not None:
        with contextlib.suppress(NotRecorded):  # e.g. generation_config.json changed
            return _parse(model_dir, path, raw, model_type, replay)
    from transformers import AutoConfig  # lazy: only configs come from transformers

    cfg = Recorder(AutoConfig.from_pretrained(str(model_dir)))
    parsed = _parse(model_dir, path, raw, model_type, cfg)
    cfg.save(cache)
    return parsed


def _parse(model_dir: str | Path, path: Path, raw: dict, model_type: str,
           cfg: Any) -> MoEModelConfig:
    """:func:`load_model_config` from the raw JSON and the (recorded) ``AutoConfig``."""
    n_layers = int(cfg.num_hidden_layers)
    n_heads = int(cfg.num_attention_heads)
    hidden = int(cfg.hidden_size)
    num_experts = int(_first(cfg, raw, "num_experts", "num_local_experts", "n_routed_experts", default=0))
    if num_experts <= 0:
        raise unsupported(f"{path} declares no experts (num_experts / num_local_experts / n_routed_experts)")
    window = None
    if model_type == "mixtral" or _first(cfg, raw, "use_sliding_window", default=False):
        window = _first(cfg, raw, "sliding_window", default=None) or None
    act = _first(cfg, raw, "hidden_act", default="silu")
    if act != "silu":
        raise unsupported(f"hidden_act {act!r} is not supported, only 'silu'")
    top_k = int(cfg.num_experts_per_tok)
    mla = None

    if model_type == "mixtral":
        moe_layers = tuple(True for _ in range(n_layers))
        moe_inter = int(cfg.intermediate_size)
        # mixtral's softmax over the top-k logits == renormalised top-k
        routing = RoutingConfig(num_experts, top_k, norm_topk_prob=True)
        qkv_bias = o_bias = False
        shared = 0
    elif model_type in DEEPSEEK_FAMILIES:
        moe_layers, routing, shared, mla = _deepseek_parts(cfg, raw, n_layers, num_experts, top_k)
        moe_inter = int(cfg.moe_intermediate_size)
        qkv_bias = o_bias = False
    else:
        step = int(_first(cfg, raw, "decoder_sparse_step", default=1))
        dense = set(_first(cfg, raw, "mlp_only_layers", default=[]) or [])
        moe_layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(n_layers))
        moe_inter = int(cfg.moe_intermediate_size)
        routing = RoutingConfig(num_experts, top_k,
                                norm_topk_prob=bool(_first(cfg, raw, "norm_topk_prob", default=False)))
        if model_type == "qwen2_moe":
            # transformers 5 names it qkv_bias; 4.x always had q/k/v biases
            qkv_bias, o_bias = bool(_first(cfg, raw, "qkv_bias", default=True)), False
            shared = int(_first(cfg, raw, "shared_expert_intermediate_size", default=0))
        else:
            qkv_bias = o_bias = bool(_first(cfg, raw, "attention_bias", default=False))
            shared = 0

    gen = _generation_config(Path(model_dir))
    eos = gen.get("eos_token_id")
    if eos is None:
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
        rope=_rope(cfg, raw),
        max_position_embeddings=int(cfg.max_position_embeddings),
        num_experts=num_experts,
        moe_intermediate_size=moe_inter,
        intermediate_size=int(_first(cfg, raw, "intermediate_size", default=moe_inter)),
        shared_expert_intermediate_size=shared,
        routing=routing,
        qk_norm=model_type == "qwen3_moe",
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        moe_layers=moe_layers,
        tie_word_embeddings=bool(_first(cfg, raw, "tie_word_embeddings", default=False)),
        eos_token_ids=tuple(int(e) for e in eos_ids),
        attention_window=int(window) if window else None,
        mla=mla,
        sampling_defaults=_sampling_defaults(gen, Path(model_dir) / "generation_config.json"),
        quantization=parse_quantization(raw, where=str(path)),
    )
