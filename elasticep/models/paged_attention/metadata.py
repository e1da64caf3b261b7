"""Where one forward pass's tokens sit in the paged KV cache, as device tensors.

Built once per step and shared by every layer; every paged-attention implementation
reads its queries' keys through it. Host ints bound the grid sizes, so no
implementation needs to read a device value on the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class DenseLayout:
    """A step's batch laid out as a padded ``[B, max_query_len] x [B, max_seq_len]`` grid.

    Attributes:
        key_slots: ``[B * max_seq_len]`` int64, the cache slot of key ``p`` of sequence
            ``i`` at ``i * max_seq_len + p`` (clamped into the cache past a sequence).
        query_rows: ``[B * max_query_len]`` int64, the token of each query cell (cells
            past a sequence's ``n_i`` repeat its last query).
        visible: ``[B, max_query_len, max_seq_len]`` bool, True where a query cell sees
            a key (not a later position, not past the sequence).
        token_cells: ``[T]`` int64, the grid cell ``i * max_query_len + j`` of each token.
    """

    key_slots: torch.Tensor
    query_rows: torch.Tensor
    visible: torch.Tensor
    token_cells: torch.Tensor


# from_lists pads block tables to a multiple of this many entries (a row stride that
# Triton's divisibility-by-16 specialization always sees alike)
TABLE_WIDTH_ALIGN = 16


@dataclass(frozen=True)
class PagedAttentionMetadata:
    """Block tables and lengths of a batch of ``B`` sequences with ``T`` new tokens.

    Sequence ``i`` owns queries ``[query_start_loc[i], query_start_loc[i+1])``, its last
    ``n_i`` tokens: query ``j`` sits at position ``seq_lens[i] - n_i + j`` and attends
    to keys ``0..`` that position. Key ``p`` of sequence ``i`` lives in cache slot
    ``block_tables[i, p // block_size] * block_size + p % block_size``.

    Attributes:
        block_tables: ``[B, max_blocks]`` int32, the blocks of each sequence in order
            (entries past a sequence's blocks are never read unmasked).
        seq_lens: ``[B]`` int32, tokens per sequence after this step (new ones included).
        query_start_loc: ``[B+1]`` int32, cumulative query counts.
        block_size: tokens per cache block.
        max_query_len, max_seq_len: host ints bounding ``n_i`` and ``seq_lens[i]``
            (upper bounds are fine; they size grids and padding).
    """

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    block_size: int
    max_query_len: int
    max_seq_len: int
    # per-step index tensors that every layer shares (see dense_layout)
    _layouts: dict[tuple[int, int], DenseLayout] = field(
        default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        """``B``, sequences in the batch."""
        return self.seq_lens.shape[0]

    @classmethod
    def from_lists(cls, tables: Sequence[Sequence[int]], seq_lens: Sequence[int],
                   query_lens: Sequence[int], block_size: int,
                   device: torch.device | str = "cpu") -> PagedAttentionMetadata:
        """Build from host lists with one host-to-device copy (pinned, non-blocking on CUDA).

        The tables are zero-padded to a width that is a multiple of
        :data:`TABLE_WIDTH_ALIGN` and each tensor starts 16 bytes into the shared
        buffer, so the kernels see the same argument specializations (pointer
        alignment, stride divisibility) whatever the batch: a new batch composition
        never compiles a Triton kernel again.

        Raises:
            ValueError: the three lists differ in length, or a table is too short.
        """
        B = len(tables)
        if len(seq_lens) != B or len(query_lens) != B:
            raise ValueError(f"{B} block tables but {len(seq_lens)} seq_lens and {len(query_lens)} query_lens")
        longest = max((len(t) for t in tables), default=0) or 1
        width = -(-longest // TABLE_WIDTH_ALIGN) * TABLE_WIDTH_ALIGN
        lens_at = B * width
        qsl_at = lens_at + -(-B // 4) * 4  # 4 int32 = 16 bytes
        flat = torch.zeros(qsl_at + B + 1, dtype=torch.int32)
        for i, (t, n) in enumerate(zip(tables, seq_lens, strict=True)):
            if len(t) * block_size < n:
                raise ValueError(f"sequence {i}: {n} tokens do not fit in {len(t)} blocks of {block_size}")
            flat[i * width:i * width + len(t)] = torch.tensor(t, dtype=torch.int32)
        flat[lens_at:lens_at + B] = torch.tensor(list(seq_lens), dtype=torch.int32)
        qsl = torch.tensor([0, *query_lens], dtype=torch.int64).cumsum(0)
        flat[qsl_at:] = qsl.to(torch.int32)
        device = torch.device(device)
        if device.type == "cuda":
            flat = flat.pin_memory().to(device, non_blocking=True)
        return cls(flat[:lens_at].view(B, width), flat[lens_at:lens_at + B], flat[qsl_at:],
                   block_size, max(query_lens, default=0), max(seq_lens, default=0))

    def check(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Check shapes, dtypes and devices against q and the caches (never reads values).

        Raises:
            ValueError: naming the first argument whose shape, dtype or device is wrong.
        """
        if q.dim() != 3 or k_cache.dim() != 3 or k_cache.shape != v_cache.shape:
            raise ValueError(f"want q [T, Hq, D] and k/v caches [slots, Hkv, D], got "
                             f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
        if q.shape[2] != k_cache.shape[2] or q.shape[1] % k_cache.shape[1]:
            raise ValueError(f"q heads {q.shape[1]} must be a multiple of kv heads {k_cache.shape[1]} "
                             f"and head dims must match ({q.shape[2]} vs {k_cache.shape[2]})")
        if k_cache.shape[0] % self.block_size:
            raise ValueError(f"cache slots {k_cache.shape[0]} not a multiple of block_size {self.block_size}")
        B = self.num_seqs
        if (self.block_tables.dim() != 2 or self.block_tables.shape[0] != B
                or self.query_start_loc.shape != (B + 1,)):
            raise ValueError(f"want block_tables [B, max_blocks], seq_lens [B], query_start_loc [B+1]; "
                             f"got {tuple(self.block_tables.shape)}, {tuple(self.seq_lens.shape)}, "
                             f"{tuple(self.query_start_loc.shape)}")
        if self.max_seq_len > self.block_tables.shape[1] * self.block_size:
            raise ValueError(f"max_seq_len {self.max_seq_len} exceeds the block table's "
                             f"{self.block_tables.shape[1]} blocks of {self.block_size}")
        for name in ("block_tables", "seq_lens", "query_start_loc"):
            t = getattr(self, name)
            if t.dtype not in (torch.int32, torch.int64) or t.device != q.device:
                raise ValueError(f"{name} must be an int32/int64 tensor on {q.device}, "
                                 f"got {t.dtype} on {t.device}")

    def token_sequence_ids(self, num_tokens: int) -> torch.Tensor:
        """Sequence index of each of the ``num_tokens`` queries -> ``[T]`` int64, on device."""
        tokens = torch.arange(num_tokens, device=self.query_start_loc.device)
        return torch.searchsorted(self.query_start_loc[1:].long(), tokens, right=True)

    def padded_queries(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries as a ``[B, max_query_len]`` grid, for implementations that pad.

        Returns:
            ``(rows, positions)``, both ``[B, max_query_len]`` int64: the token index of
            each grid cell and its position in the sequence. Cells past a sequence's
            ``n_i`` repeat its last query (finite, and dropped by :meth:`unpad`).
        """
        qsl = self.query_start_loc.long()
        n = qsl[1:] - qsl[:-1]
        j = torch.arange(self.max_query_len, device=qsl.device)
        jj = torch.minimum(j[None, :], (n - 1).clamp(min=0)[:, None])
        rows = (qsl[:-1, None] + jj).clamp_(0, max(num_tokens - 1, 0))
        return rows, self.seq_lens.long()[:, None] - n[:, None] + jj

    def unpad(self, grid: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """``[B, max_query_len, ...]`` back to the ``[T, ...]`` tokens it holds."""
        seq = self.token_sequence_ids(num_tokens)
        j = torch.arange(num_tokens, device=seq.device) - self.query_start_loc.long()[seq]
        return grid[seq, j]

    def dense_layout(self, num_tokens: int, num_slots: int) -> DenseLayout:
        """The padded grid of this step for implementations that gather (the reference).

        Built on the first call and kept on this metadata, so the layers of a step share
        one set of index tensors (about fifteen small ops a layer otherwise). The
        metadata's tensors must not be changed in place after that call.

        Args:
            num_tokens: T, the step's query tokens.
            num_slots: cache slots (``num_blocks * block_size``); key slots are clamped
                below it.
        """
        key = (num_tokens, num_slots)
        if key not in self._layouts:
            kpos = torch.arange(self.max_seq_len, device=self.block_tables.device)
            blocks = self.block_tables.long()[:, kpos // self.block_size]  # [B, S]
            slots = (blocks * self.block_size + kpos % self.block_size).clamp_(0, num_slots - 1)
            rows, qpos = self.padded_queries(num_tokens)  # [B, Mq]
            visible = kpos[None, None, :] <= qpos[:, :, None]  # [B, Mq, S]
            seq = self.token_sequence_ids(num_tokens)
            j = torch.arange(num_tokens, device=seq.device) - self.query_start_loc.long()[seq]
            self._layouts[key] = DenseLayout(slots.reshape(-1), rows.reshape(-1),
                                             visible, seq * self.max_query_len + j)
        return self._layouts[key]
