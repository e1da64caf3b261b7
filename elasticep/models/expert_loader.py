"""Expert weights into a rank's slots: one logical expert at a time, read into the
preallocated slot tensors (bf16/fp32, or packed block FP8), at load time and to reload
an orphaned expert after a rank dies.

On-disk expert layouts understood, per MoE layer (first match wins):
- per expert: ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (qwen) or
  ``block_sparse_moe.experts.{e}.{w1,w3,w2}.weight`` (mixtral: w1 gate, w3 up, w2 down);
- fused: ``mlp.experts.gate_up_proj [E, 2I, H]`` and ``mlp.experts.down_proj [E, H, I]``
  (transformers 5 module layout).
"""

from __future__ import annotations

import torch

from elasticep.models.config import MoEModelConfig, unsupported
from elasticep.models.fp8_reader import Fp8BlockReader
from elasticep.models.quantization import experts_packable
from elasticep.models.weight_source import WeightReader
from elasticep.moe.experts import fp8_block
from elasticep.moe.local_executor import ExpertSlots


def _moe_prefixes(cfg: MoEModelConfig, layer: int) -> list[str]:
    base = f"model.layers.{layer}"
    if cfg.model_type == "mixtral":
        return [f"{base}.block_sparse_moe", f"{base}.mlp"]
    return [f"{base}.mlp"]


def expert_keys(cfg: MoEModelConfig, reader: WeightReader, layer: int) -> tuple[str, str]:
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
    kind, prefix = expert_keys(cfg, reader, layer)
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
    kind, prefix = expert_keys(cfg, reader, layer)
    key = (f"{prefix}.experts.gate_up_proj" if kind == "fused"
           else f"{prefix}.experts.0.{_per_expert_names(reader, prefix)[0]}.weight")
    return reader.expert_fp8(key)

