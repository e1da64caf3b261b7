"""Turn a scheduled batch into one forward pass over the paged KV cache.

``forward`` reads request state but never mutates it; its only side effect is writing
K/V to the slots of the scheduled positions, which a redo rewrites identically.
"""

from __future__ import annotations

import torch

from elasticep.engine.kv_cache import KVCache
from elasticep.engine.scheduler import ScheduledBatch
from elasticep.models.layers import AttentionMetadata
from elasticep.models.model import MoECausalLM


class ModelRunner:
    """Owns the KV cache tensors of one model and runs batches through the model.

    Args:
        model: the loaded model.
        num_blocks, block_size: KV-cache geometry (capacity = product, in tokens).
    """

    def __init__(self, model: MoECausalLM, num_blocks: int, block_size: int) -> None:
        self.model = model
        self.kv_cache = KVCache(
            model.config.num_hidden_layers, num_blocks, block_size, model.kv_cache_shapes(),
            model.dtype, model.device,
        )

    def prepare(
        self, batch: ScheduledBatch
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Build ``(input_ids [T], positions [T], meta, last_token_rows [B])`` for ``batch``."""
        dev = self.model.device
        if not batch.items:  # an idle EP rank still runs every layer (empty dispatch)
            empty = torch.zeros(0, dtype=torch.long, device=dev)
            return empty, empty, AttentionMetadata([0], [], empty, []), empty
        ids: list[int] = []
        starts = [0]
        slot_parts, gather, ctx_lens = [], [], []
        for it in batch.items:
            seq = it.seq
            ids.extend(seq.all_token_ids[it.start : it.end])
            starts.append(starts[-1] + it.end - it.start)
            slot_parts.append(self.kv_cache.slots(seq.block_table, it.start, it.end))
            gather.append(self.kv_cache.slots(seq.block_table, 0, it.end).to(dev))
            ctx_lens.append(it.end)
        positions = torch.cat([torch.arange(it.start, it.end) for it in batch.items])
        meta = AttentionMetadata(starts, ctx_lens, torch.cat(slot_parts).to(dev), gather)
        last = torch.tensor(starts[1:], dtype=torch.long) - 1
        return torch.tensor(ids, dtype=torch.long, device=dev), positions.to(dev), meta, last.to(dev)

    def forward(self, batch: ScheduledBatch, all_logits: bool = False) -> torch.Tensor:
        """Run ``batch``; return float32 logits ``[B, V]`` of each sequence's last token
        (or ``[T, V]`` for every scheduled token when ``all_logits``)."""
        input_ids, positions, meta, last = self.prepare(batch)
        return self.model.forward(
            input_ids, positions, meta, self.kv_cache.layers, None if all_logits else last
        )
