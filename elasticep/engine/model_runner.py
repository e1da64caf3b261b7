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
from elasticep.models.paged_attention import PagedAttentionMetadata


class ModelRunner:
    """Owns the KV cache tensors of one model and runs batches through the model.

    Args:
        model: the loaded model.
        num_blocks, block_size: KV-cache geometry (capacity = product, in tokens).
    """

    def __init__(self, model: MoECausalLM, num_blocks: int, block_size: int) -> None:
        c = model.config
        self.model = model
        self.kv_cache = KVCache(
            c.num_hidden_layers, num_blocks, block_size, c.num_key_value_heads, c.head_dim,
            model.dtype, model.device,
        )

    def prepare(
        self, batch: ScheduledBatch
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Build ``(input_ids [T], positions [T], meta, last_token_rows [B])`` for ``batch``.

        Everything is computed in host lists and reaches the device in two copies (the
        token-indexed ints, and the block tables); a per-sequence tensor would cost a
        launch or a copy per sequence per step.
        """
        dev = self.model.device
        if not batch.items:  # an idle EP rank still runs every layer (empty dispatch)
            empty = torch.zeros(0, dtype=torch.long, device=dev)
            return empty, empty, AttentionMetadata([0], [], empty), empty
        bs = self.kv_cache.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts, ctx_lens, query_lens, tables = [0], [], [], []
        for it in batch.items:
            seq, table = it.seq, it.seq.block_table
            tokens = seq.all_token_ids if it.end - it.start > 1 else None
            for p in range(it.start, it.end):
                ids.append(tokens[p] if tokens is not None else seq.token_at(p))
                positions.append(p)
                slots.append(table[p // bs] * bs + p % bs)
            starts.append(starts[-1] + it.end - it.start)
            ctx_lens.append(it.end)
            query_lens.append(it.end - it.start)
            tables.append(table)
        T, B = len(ids), len(ctx_lens)
        host = torch.tensor(ids + positions + slots + [s - 1 for s in starts[1:]], dtype=torch.long)
        if dev.type == "cuda":
            host = host.pin_memory()
        flat = host.to(dev, non_blocking=True)
        paged = PagedAttentionMetadata.from_lists(tables, ctx_lens, query_lens, bs, dev)
        meta = AttentionMetadata(starts, ctx_lens, flat[2 * T:3 * T], paged)
        return flat[:T], flat[T:2 * T], meta, flat[3 * T:3 * T + B]

    def forward(self, batch: ScheduledBatch, all_logits: bool = False) -> torch.Tensor:
        """Run ``batch``; return float32 logits ``[B, V]`` of each sequence's last token
        (or ``[T, V]`` for every scheduled token when ``all_logits``)."""
        input_ids, positions, meta, last = self.prepare(batch)
        return self.model.forward(
            input_ids, positions, meta, self.kv_cache.layers, None if all_logits else last
        )
