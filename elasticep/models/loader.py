"""Per-rank loader: all non-expert weights plus only the experts a placement assigns.

The placement is ``slot_to_logical [L, S]`` (int64): the logical expert each of this
rank's S physical slots holds, per decoder layer. The default is the identity (every
expert, S = E). Expert tensors are read one expert at a time into preallocated slot
tensors, so peak memory stays near the size of what the rank keeps.

Where the weights come from is :mod:`.weight_source`; how an expert's tensors are found
and read into a slot is :mod:`.expert_loader`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from tqdm import tqdm

from elasticep.models.config import MoEModelConfig, load_model_config
from elasticep.models.expert_loader import (
    alloc_expert_slots,
    expert_keys,
    experts_fp8,
    load_expert_into_slot,
)
from elasticep.models.fp8_reader import Fp8BlockReader
from elasticep.models.linear import Fp8Weight, Weight, rows_stay_in_blocks
from elasticep.models.mla import MLAWeights
from elasticep.models.model import AttentionWeights, DecoderLayerWeights, MoECausalLM
from elasticep.models.moe_block import DenseMLPWeights, MoEBlockWeights
from elasticep.models.rope import deinterleave_rows
from elasticep.models.weight_source import WeightReader, open_weights
from elasticep.moe.local_executor import LocalExpertExecutor


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
        _, prefix = expert_keys(cfg, reader, i)
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
