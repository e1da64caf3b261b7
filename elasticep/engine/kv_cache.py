"""Paged KV cache: fixed-size blocks of token slots, and the block manager that lends them.

Slot ``b * block_size + j`` holds token ``j`` of block ``b``. The manager is pure
bookkeeping (no tensors), so scheduling is testable without a model.
"""

from __future__ import annotations

from collections import deque

import torch


class BlockManager:
    """Hands out KV blocks; a sequence of n tokens needs ``ceil(n / block_size)`` blocks.

    Args:
        num_blocks: total blocks in the cache.
        block_size: tokens per block.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        """Blocks not held by any sequence."""
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        """Tokens the whole cache can hold."""
        return self.num_blocks * self.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def can_grow(self, block_table: list[int], num_tokens: int) -> bool:
        """True when ``block_table`` can be extended to hold ``num_tokens`` tokens."""
        return self.blocks_needed(num_tokens) - len(block_table) <= self.num_free_blocks

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Append blocks to ``block_table`` (in place) until it holds ``num_tokens``.

        Raises:
            RuntimeError: not enough free blocks (call :meth:`can_grow` first).
        """
        need = self.blocks_needed(num_tokens) - len(block_table)
        if need > self.num_free_blocks:
            raise RuntimeError(f"KV cache out of blocks: need {need}, free {self.num_free_blocks}")
        for _ in range(max(need, 0)):
            block_table.append(self._free.popleft())

    def free(self, block_table: list[int]) -> None:
        """Return every block of ``block_table`` and empty it."""
        self._free.extend(block_table)
        block_table.clear()


class KVCache:
    """Per-layer cache tensors ``[num_blocks * block_size, *shape]``, one per per-token shape.

    The model says what a token stores per layer (``MoECausalLM.kv_cache_shapes()``):
    ``((Hkv, D), (Hkv, D))`` for K and V, or one latent row ``((kv_lora_rank +
    qk_rope_head_dim,),)`` for MLA.

    Args:
        num_layers, num_blocks, block_size: sizes.
        per_token_shapes: the per-token shape of each tensor of one layer.
        dtype, device: storage dtype (the model dtype) and device.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        per_token_shapes: tuple[tuple[int, ...], ...],
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        n = num_blocks * block_size
        self.block_size = block_size
        self.layers = [
            tuple(torch.zeros(n, *shape, dtype=dtype, device=device) for shape in per_token_shapes)
            for _ in range(num_layers)
        ]

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes one token takes over all layers."""
        return sum(t[0].numel() * t.element_size() for layer in self.layers for t in layer)

    def slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """Flat slots of token positions ``[start, end)`` of a sequence -> ``[end-start]`` int64."""
        pos = torch.arange(start, end)
        table = torch.tensor(block_table, dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size
