"""Per-rank loader: all non-expert weights plus only the experts a placement assigns.

The placement is ``slot_to_logical [L, S]`` (int64): the logical expert each of this
rank's S physical slots holds, per decoder layer. The default is the identity (every
expert, S = E). Expert tensors are read one expert at a time into preallocated slot
tensors, so peak memory stays near the size of what the rank keeps.

On-disk expert layouts understood, per MoE layer (first match wins):
- per expert: ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (qwen) or
  ``block_sparse_moe.experts.{e}.{w1,w3,w2}.weight`` (mixtral: w1 gate, w3 up, w2 down);
- fused: ``mlp.experts.gate_up_proj [E, 2I, H]`` and ``mlp.experts.down_proj [E, H, I]``
  (transformers 5 module layout).
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from elasticep.config import LoadFormat
from elasticep.models.checkpoint import CheckpointReader
from elasticep.models.config import MoEModelConfig, load_model_config, unsupported
from elasticep.models.dummy_weights import DEFAULT_STD, DummyWeightReader
from elasticep.models.fp8_reader import Fp8BlockReader
from elasticep.models.linear import Fp8Weight, Weight, rows_stay_in_blocks
from elasticep.models.mla import MLAWeights
from elasticep.models.model import AttentionWeights, DecoderLayerWeights, MoECausalLM
from elasticep.models.moe_block import DenseMLPWeights, MoEBlockWeights
from elasticep.models.quantization import experts_packable, parse_quantization
from elasticep.models.rope import deinterleave_rows
from elasticep.moe.experts import fp8_block
from elasticep.moe.local_executor import ExpertSlots, LocalExpertExecutor

# vLLM's names: "auto" and "safetensors" read the checkpoint; "dummy" draws from a seed.
LOAD_FORMATS = tuple(f.value for f in LoadFormat)

WeightReader = CheckpointReader | DummyWeightReader | Fp8BlockReader


def open_weights(model_dir: str | Path, load_format: str = "auto", seed: int = 0,
                 config: MoEModelConfig | None = None,
                 quantization: str | None = None) -> WeightReader:
    """The weight reader of ``model_dir`` for ``load_format`` (use it as a context manager).

    Args:
        model_dir: checkpoint directory; for "dummy" only ``config.json`` is read.
        load_format: one of :data:`LOAD_FORMATS`.
        seed: the dummy weights' seed (ignored otherwise).
        config: the parsed config, if the caller has it.
        quantization: ``--quantization`` (None or "fp8": quantize an unquantized
            checkpoint to block FP8 while reading).

    Returns:
        A reader; for a block-FP8 checkpoint (or with ``quantization``) an
        :class:`~elasticep.models.fp8_reader.Fp8BlockReader` that dequantizes exactly.

    Raises:
        ValueError: unknown format, or what the reader raises (no safetensors, bad config);
            :class:`~elasticep.models.quantization.UnsupportedQuantizationError` for a
            quantization we cannot read.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load format {load_format!r}; choose from {', '.join(LOAD_FORMATS)}")
    cfg = config or load_model_config(model_dir)
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    quant = parse_quantization(raw, quantization, str(Path(model_dir) / "config.json"))
    reader: WeightReader
    if load_format in ("auto", "safetensors"):
        reader = CheckpointReader(model_dir)
    else:
        reader = DummyWeightReader(model_dir, cfg, seed=seed,
                                   std=float(raw.get("initializer_range") or DEFAULT_STD))
        if quant is not None:  # drawn weights are unquantized: round them through FP8
            quant = replace(quant, online=True)
    return reader if quant is None else Fp8BlockReader(reader, quant)


def _moe_prefixes(cfg: MoEModelConfig, layer: int) -> list[str]:
    base = f"model.layers.{layer}"
    if cfg.model_type == "mixtral":
        return [f"{base}.block_sparse_moe", f"{base}.mlp"]
    return [f"{base}.mlp"]


def _expert_keys(cfg: MoEModelConfig, reader: WeightReader, layer: int) -> tuple[str, str]:
    """Return (kind, prefix): kind is "fused" or "per_expert" for this layer's experts."""
    for prefix in _moe_prefixes(cfg, layer):
        if reader.has(f"{prefix}.experts.gate_up_proj"):
            return "fused", prefix
        for name in ("gate_proj", "w1"):
            if reader.has(f"{prefix}.experts.0.{name}.weight"):
                return "per_expert", prefix
    raise unsupported(f"missing expert tensors for layer {layer} under {_moe_prefixes(cfg, layer)}")


def load_expert_into_slot(
    reader: WeightReader,
    cfg: MoEModelConfig,
    slots: ExpertSlots,
    layer: int,
    slot: int,
    logical_expert: int,
) -> None:
    """Read logical expert ``logical_expert`` of ``layer`` into physical ``slot``.

    Used at load time and to reload an orphaned expert after a rank dies. Updates
    ``slots.slot_to_logical[layer, slot]``; callers with a cached map must refresh it
    (e.g. :meth:`LocalExpertExecutor.refresh`).

    Raises:
        ValueError: missing tensor, wrong shape, or an expert id out of range.
    """
    if not 0 <= logical_expert < cfg.num_experts:
        raise ValueError(f"logical expert {logical_expert} out of range [0, {cfg.num_experts})")
    w13, w2 = slots.w13[layer], slots.w2[layer]
    if w13 is None or w2 is None:
        raise ValueError(f"layer {layer} is not an MoE layer")
    hid, inter = cfg.hidden_size, cfg.moe_intermediate_size
    dtype, device = w13.dtype, w13.device
    kind, prefix = _expert_keys(cfg, reader, layer)
    if fp8_block.is_packed(w13):
        _load_fp8_expert(reader, cfg, kind, prefix, logical_expert, w13[slot], w2[slot])
    elif kind == "fused":
        w13[slot].copy_(
            reader.get_row(f"{prefix}.experts.gate_up_proj", logical_expert, (2 * inter, hid), dtype, device)
        )
        w2[slot].copy_(
            reader.get_row(f"{prefix}.experts.down_proj", logical_expert, (hid, inter), dtype, device)
        )
    else:
        names = ("w1", "w3", "w2") if reader.has(f"{prefix}.experts.0.w1.weight") else (
            "gate_proj", "up_proj", "down_proj")
        p = f"{prefix}.experts.{logical_expert}"
        w13[slot, :inter].copy_(reader.get(f"{p}.{names[0]}.weight", (inter, hid), dtype, device))
        w13[slot, inter:].copy_(reader.get(f"{p}.{names[1]}.weight", (inter, hid), dtype, device))
        w2[slot].copy_(reader.get(f"{p}.{names[2]}.weight", (hid, inter), dtype, device))
    slots.slot_to_logical[layer, slot] = logical_expert


def _per_expert_names(reader: WeightReader, prefix: str) -> tuple[str, str, str]:
    # mixtral's w1/w3/w2 or the qwen/deepseek gate/up/down projections
    if reader.has(f"{prefix}.experts.0.w1.weight"):
        return "w1", "w3", "w2"
    return "gate_proj", "up_proj", "down_proj"


def _load_fp8_expert(reader: Fp8BlockReader, cfg: MoEModelConfig, kind: str, prefix: str,
                     expert: int, w13: torch.Tensor, w2: torch.Tensor) -> None:
    """Read one expert as block FP8 into its packed slot rows ``w13 [2I + e, H]`` and
    ``w2 [H + e', I]`` (uint8). The gate and up halves' scale grids stack into the fused
    weight's because I is a multiple of the block (:func:`fp8_experts_packable`)."""
    hid, inter, dev = cfg.hidden_size, cfg.moe_intermediate_size, w13.device
    if kind == "fused":
        q13, s13 = reader.get_fp8(f"{prefix}.experts.gate_up_proj", (2 * inter, hid), dev,
                                  row=expert)
        q2, s2 = reader.get_fp8(f"{prefix}.experts.down_proj", (hid, inter), dev, row=expert)
    else:
        g, u, d = _per_expert_names(reader, prefix)
        p = f"{prefix}.experts.{expert}"
        qg, sg = reader.get_fp8(f"{p}.{g}.weight", (inter, hid), dev)
        qu, su = reader.get_fp8(f"{p}.{u}.weight", (inter, hid), dev)
        q13, s13 = torch.cat([qg, qu]), torch.cat([sg, su])
        q2, s2 = reader.get_fp8(f"{p}.{d}.weight", (hid, inter), dev)
    fp8_block.pack(q13, s13, out=w13)
    fp8_block.pack(q2, s2, out=w2)


def fp8_experts_packable(cfg: MoEModelConfig) -> bool:
    """:func:`~elasticep.models.quantization.experts_packable` of ``cfg``'s experts."""
    return experts_packable(cfg.hidden_size, cfg.moe_intermediate_size)


def alloc_expert_slots(cfg: MoEModelConfig, slot_to_logical: torch.Tensor, dtype: torch.dtype,
                       device: torch.device | str, fp8: bool) -> ExpertSlots:
    """Uninitialised expert slots for ``slot_to_logical [L, S]``: per MoE layer ``w13 [S,
    2I, H]`` and ``w2 [S, H, I]`` of ``dtype``, or with ``fp8`` packed FP8 slots (uint8
    ``[S, 2I + e, H]`` and ``[S, H + e', I]``, weights and block scales together,
    :mod:`elasticep.moe.experts.fp8_block`)."""
    hid, inter, S = cfg.hidden_size, cfg.moe_intermediate_size, slot_to_logical.shape[1]
    if fp8:
        r13, r2, dt = fp8_block.packed_rows(2 * inter, hid), fp8_block.packed_rows(hid, inter), torch.uint8
    else:
        r13, r2, dt = 2 * inter, hid, dtype
    return ExpertSlots(
        w13=[torch.empty(S, r13, hid, dtype=dt, device=device) if m else None
             for m in cfg.moe_layers],
        w2=[torch.empty(S, r2, inter, dtype=dt, device=device) if m else None
            for m in cfg.moe_layers],
        slot_to_logical=slot_to_logical,
    )


def experts_fp8(reader: WeightReader, cfg: MoEModelConfig) -> bool:
    """Whether this checkpoint's experts load as packed FP8 slots."""
    layer = next((i for i, m in enumerate(cfg.moe_layers) if m), None)
    if not isinstance(reader, Fp8BlockReader) or layer is None or not fp8_experts_packable(cfg):
        return False
    kind, prefix = _expert_keys(cfg, reader, layer)
    key = (f"{prefix}.experts.gate_up_proj" if kind == "fused"
           else f"{prefix}.experts.0.{_per_expert_names(reader, prefix)[0]}.weight")
    return reader.expert_fp8(key)


def _proj(reader: WeightReader, key: str, shape: tuple[int, int], dt, dev) -> Weight:
    """A dense projection: block FP8 where the checkpoint holds it so (stored with its
    scales, or quantized while loading), else read in ``dt``."""
    if isinstance(reader, Fp8BlockReader) and reader.is_fp8(key, shape):
        return Fp8Weight(*reader.get_fp8(key, shape, dev))
    return reader.get(key, shape, dt, dev)


def _deinterleaved(w: Weight, heads: int, head_dim: int, rope_start: int, dt) -> Weight:
    """:func:`deinterleave_rows` of a plain or FP8 projection. An FP8 one keeps its scales
    where each permuted row stays in its 128-row scale block (DeepSeek-V3's q_b and
    kv_a rows do); otherwise it is dequantized exactly into ``dt`` first."""
    if isinstance(w, Fp8Weight):
        order = deinterleave_rows(torch.arange(w.shape[0]), heads, head_dim, rope_start)
        if rows_stay_in_blocks(order):
            return w.permute_rows(order)
        w = w.dequantize(dt)
    return deinterleave_rows(w, heads, head_dim, rope_start)


def _dense(reader: WeightReader, p: str, hid: int, inter: int, dt, dev) -> DenseMLPWeights:
    w = DenseMLPWeights(
        gate=_proj(reader, f"{p}.gate_proj.weight", (inter, hid), dt, dev),
        up=_proj(reader, f"{p}.up_proj.weight", (inter, hid), dt, dev),
        down=_proj(reader, f"{p}.down_proj.weight", (hid, inter), dt, dev),
    )
    w.fuse_gate_up()
    return w


def _mla(reader: WeightReader, cfg: MoEModelConfig, a: str, dt, dev) -> MLAWeights:
    """Read ``a``'s MLA projections; interleaved rotary rows are made half-split.
    ``kv_b`` is always dequantized (see :class:`MLAWeights`)."""
    m, hid = cfg.mla, cfg.hidden_size
    q_rows = m.num_heads * m.qk_head_dim

    def q_rows_split(t: Weight) -> Weight:
        if not m.rope_interleave:
            return t
        return _deinterleaved(t, m.num_heads, m.qk_head_dim, m.qk_nope_head_dim, dt)

    w = MLAWeights(
        kv_a=_proj(reader, f"{a}.kv_a_proj_with_mqa.weight", (m.cache_width, hid), dt, dev),
        kv_a_norm=reader.get(f"{a}.kv_a_layernorm.weight", (m.kv_lora_rank,), dt, dev),
        kv_b=reader.get(f"{a}.kv_b_proj.weight",
                        (m.num_heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank), dt, dev),
        o=_proj(reader, f"{a}.o_proj.weight", (hid, m.num_heads * m.v_head_dim), dt, dev),
    )
    if m.rope_interleave:
        w.kv_a = _deinterleaved(w.kv_a, 1, m.cache_width, m.kv_lora_rank, dt)
    if m.q_lora_rank is None:
        w.q = q_rows_split(_proj(reader, f"{a}.q_proj.weight", (q_rows, hid), dt, dev))
    else:
        w.q_a = _proj(reader, f"{a}.q_a_proj.weight", (m.q_lora_rank, hid), dt, dev)
        w.q_a_norm = reader.get(f"{a}.q_a_layernorm.weight", (m.q_lora_rank,), dt, dev)
        w.q_b = q_rows_split(_proj(reader, f"{a}.q_b_proj.weight", (q_rows, m.q_lora_rank),
                                   dt, dev))
    return w


def _gqa(reader: WeightReader, cfg: MoEModelConfig, a: str, dt, dev) -> AttentionWeights:
    hid, d = cfg.hidden_size, cfg.head_dim
    qd, kvd = cfg.num_attention_heads * d, cfg.num_key_value_heads * d

    def bias(name: str, n: int, on: bool) -> torch.Tensor | None:
        return reader.get(f"{a}.{name}.bias", (n,), dt, dev) if on else None

    w = AttentionWeights(
        q=_proj(reader, f"{a}.q_proj.weight", (qd, hid), dt, dev),
        k=_proj(reader, f"{a}.k_proj.weight", (kvd, hid), dt, dev),
        v=_proj(reader, f"{a}.v_proj.weight", (kvd, hid), dt, dev),
        o=_proj(reader, f"{a}.o_proj.weight", (hid, qd), dt, dev),
        q_bias=bias("q_proj", qd, cfg.qkv_bias),
        k_bias=bias("k_proj", kvd, cfg.qkv_bias),
        v_bias=bias("v_proj", kvd, cfg.qkv_bias),
        o_bias=bias("o_proj", hid, cfg.o_bias),
        q_norm=reader.get(f"{a}.q_norm.weight", (d,), dt, dev) if cfg.qk_norm else None,
        k_norm=reader.get(f"{a}.k_norm.weight", (d,), dt, dev) if cfg.qk_norm else None,
    )
    w.fuse_qkv()
    return w


def _layer(reader: WeightReader, cfg: MoEModelConfig, i: int, dt, dev) -> DecoderLayerWeights:
    hid = cfg.hidden_size
    p = f"model.layers.{i}"
    attn = (_mla if cfg.mla is not None else _gqa)(reader, cfg, f"{p}.self_attn", dt, dev)
    moe = mlp = None
    if cfg.moe_layers[i]:
        _, prefix = _expert_keys(cfg, reader, i)
        moe = MoEBlockWeights(router=reader.get(f"{prefix}.gate.weight", (cfg.num_experts, hid), dt, dev))
        if cfg.routing.topk_method == "noaux_tc":  # a bias that only steers the choice: keep it fp32
            moe.router_bias = reader.get(f"{prefix}.gate.e_score_correction_bias", (cfg.num_experts,),
                                         torch.float32, dev)
        if cfg.shared_expert_intermediate_size > 0:
            # qwen2_moe: one gated shared_expert; DeepSeek: n_shared_experts fused as shared_experts
            name = "shared_experts" if cfg.mla is not None else "shared_expert"
            moe.shared = _dense(reader, f"{p}.mlp.{name}", hid, cfg.shared_expert_intermediate_size, dt, dev)
            moe.shared_gate = reader.get_optional(f"{p}.mlp.shared_expert_gate.weight", (1, hid), dt, dev)
    else:
        mlp = _dense(reader, f"{p}.mlp", hid, cfg.intermediate_size, dt, dev)
    return DecoderLayerWeights(
        input_norm=reader.get(f"{p}.input_layernorm.weight", (hid,), dt, dev),
        post_attn_norm=reader.get(f"{p}.post_attention_layernorm.weight", (hid,), dt, dev),
        attn=attn,
        moe=moe,
        mlp=mlp,
    )


def load_model(
    model_dir: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    slot_to_logical: torch.Tensor | None = None,
    progress: bool = True,
    load_format: str = "auto",
    seed: int = 0,
    quantization: str | None = None,
) -> MoECausalLM:
    """Load a checkpoint for one rank.

    Args:
        model_dir: directory with ``config.json`` and ``*.safetensors``.
        dtype: weight/activation dtype (float32 or bfloat16).
        device: "cpu" or "cuda".
        slot_to_logical: ``[L, S]`` int64 placement, id E marking an empty slot (zeros);
            None = all E experts in order.
        progress: show a tqdm bar on stderr.
        load_format: "auto"/"safetensors" read ``*.safetensors``; "dummy" draws every
            tensor from ``seed`` (:mod:`elasticep.models.dummy_weights`).
        seed: the dummy weights' seed.
        quantization: None, or "fp8" to quantize an unquantized checkpoint to block FP8
            while loading (a block-FP8 checkpoint is read as such either way). FP8
            experts stay FP8, packed with their scales into their slots (where the
            shape allows, :func:`fp8_experts_packable`); so do the dense projections
            the checkpoint holds in FP8 (attention, MLA but ``kv_b``, shared experts,
            dense MLPs: :class:`~elasticep.models.linear.Fp8Weight`). What it keeps
            unquantized (embeddings, norms, router gates, the LM head,
            ``modules_to_not_convert``) is read in ``dtype``.

    Returns:
        A :class:`MoECausalLM` whose executor is a :class:`LocalExpertExecutor` over the
        loaded slots (replace ``model.executor`` for expert parallelism).

    Raises:
        ValueError: unsupported family or quantization, missing tensor, wrong shape or
            bad placement.
    """
    cfg = load_model_config(model_dir)
    n_layers, hid = cfg.num_hidden_layers, cfg.hidden_size
    if slot_to_logical is None:
        slot_to_logical = torch.arange(cfg.num_experts).repeat(n_layers, 1)
    slot_to_logical = torch.as_tensor(slot_to_logical, dtype=torch.long).clone()
    if slot_to_logical.dim() != 2 or slot_to_logical.shape[0] != n_layers:
        raise ValueError(f"slot_to_logical must be [{n_layers}, S], got {list(slot_to_logical.shape)}")
    # id num_experts marks an EMPTY slot (a reserved one, see eplb.placement): zeros
    if slot_to_logical.numel() and not bool(
        ((slot_to_logical >= 0) & (slot_to_logical <= cfg.num_experts)).all()
    ):
        raise ValueError(f"slot_to_logical holds ids outside [0, {cfg.num_experts}] "
                         f"({cfg.num_experts}: an empty slot)")
    num_slots = slot_to_logical.shape[1]
    with open_weights(model_dir, load_format, seed, cfg, quantization) as reader:
        slots = alloc_expert_slots(cfg, slot_to_logical, dtype, device, experts_fp8(reader, cfg))
        embed = reader.get("model.embed_tokens.weight", (cfg.vocab_size, hid), dtype, device)
        layers = []
        bar = tqdm(range(n_layers), desc=f"loading {Path(model_dir).name}", unit="layer",
                   file=sys.stderr, disable=not progress)
        for i in bar:
            layers.append(_layer(reader, cfg, i, dtype, device))
            if cfg.moe_layers[i]:
                for s in range(num_slots):
                    e = int(slot_to_logical[i, s])
                    if e == cfg.num_experts:  # zeros: packed FP8 zeros too (scale 0)
                        slots.w13[i][s].zero_()
                        slots.w2[i][s].zero_()
                    else:
                        load_expert_into_slot(reader, cfg, slots, i, s, e)
        final_norm = reader.get("model.norm.weight", (hid,), dtype, device)
        if reader.has("lm_head.weight") or not cfg.tie_word_embeddings:
            lm_head = reader.get("lm_head.weight", (cfg.vocab_size, hid), dtype, device)
        else:
            lm_head = embed
    executor = LocalExpertExecutor(slots, cfg.num_experts)
    return MoECausalLM(cfg, embed, layers, final_norm, lm_head, slots, executor)


def reload_expert(
    model: MoECausalLM, model_dir: str | Path, layer: int, slot: int, logical_expert: int,
    load_format: str = "auto", seed: int = 0, quantization: str | None = None,
) -> None:
    """Reload one expert of ``model`` from its checkpoint into ``slot`` (orphan reload).

    Refreshes the model's executor map when it has one (``refresh()``).
    """
    with open_weights(model_dir, load_format, seed, model.config, quantization) as reader:
        load_expert_into_slot(reader, model.config, model.experts, layer, slot, logical_expert)
    model.executor.refresh()
