"""Paged attention with ``torch.nn.attention.flex_attention`` over the physical cache.

K and V stay where they are: the cache ``[slots, Hkv, D]`` is viewed as one batch row
``[1, Hkv, slots, D]`` and each sequence's ``BlockMask`` row lists its physical blocks
(the block table) as its key blocks, the layout of PyTorch's experimental
``PagedAttention``. The mask function maps a physical key slot back to (owner
sequence, logical position) through two per-block tables built on the device each
step, so the compiled kernel is reused across steps: only the shapes change, and the
function is compiled with ``dynamic=True``.

Assumes each cache block belongs to at most one sequence (no shared prefix blocks).
The block mask is built once per :class:`PagedAttentionMetadata` (per step) and reused
by every layer.
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from elasticep.models.paged_attention.metadata import PagedAttentionMetadata

Q_BLOCK = 128  # query rows per BlockMask row block (flex's default sparse block size)
# (meta, num_slots, static, padded meta, mask) of the last call: every layer of a step reuses it
_last_mask: tuple[PagedAttentionMetadata, int, bool, PagedAttentionMetadata, BlockMask] | None = None


def build_block_mask(meta: PagedAttentionMetadata, num_slots: int) -> BlockMask:
    """The BlockMask of a step: per sequence, its blocks up to what its queries see.

    Args:
        meta: the step's block tables and lengths (device tensors, host bounds).
        num_slots: cache slots (``num_blocks * block_size``), the key length flex sees.

    Returns:
        A BlockMask of batch ``B``, one head, ``max_query_len`` query rows, key blocks of
        ``block_size`` slots; no tensor value is read on the host.
    """
    page = meta.block_size
    dev = meta.seq_lens.device
    B, max_blocks = meta.block_tables.shape
    num_blocks = num_slots // page
    seq_lens = meta.seq_lens.long()
    qsl = meta.query_start_loc.long()
    first_pos = seq_lens - (qsl[1:] - qsl[:-1])
    # owner and logical index of every physical block; unused table entries go to a spare row
    used = torch.arange(max_blocks, device=dev)[None, :] < ((seq_lens + page - 1) // page)[:, None]
    dest = torch.where(used, meta.block_tables.long(), num_blocks).flatten()
    owner = torch.full((num_blocks + 1,), -1, dtype=torch.int64, device=dev)
    owner.scatter_(0, dest, torch.arange(B, device=dev).repeat_interleave(max_blocks))
    logical = torch.zeros(num_blocks + 1, dtype=torch.int64, device=dev)
    logical.scatter_(0, dest, torch.arange(max_blocks, device=dev).repeat(B))

    def mask_mod(b, h, q_idx, kv_idx):
        blk = kv_idx // page
        pos = logical[blk] * page + kv_idx % page
        return (owner[blk] == b) & (pos <= first_pos[b] + q_idx)

    # key blocks a query row block needs: up to its last query's position
    num_q_blocks = -(-meta.max_query_len // Q_BLOCK)
    qb = torch.arange(num_q_blocks, device=dev)
    last = torch.minimum(seq_lens[:, None] - 1, first_pos[:, None] + (qb[None, :] + 1) * Q_BLOCK - 1)
    kv_num_blocks = (last // page + 1).to(torch.int32)[:, None, :]  # [B, 1, nQB]
    # flex sizes the key axis by the index width, so rows are as wide as the whole cache
    kv_indices = torch.zeros(B, 1, num_q_blocks, num_blocks, dtype=torch.int32, device=dev)
    width = min(max_blocks, num_blocks)
    kv_indices[..., :width] = meta.block_tables[:, None, None, :width]
    return BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, BLOCK_SIZE=(Q_BLOCK, page),
                                    mask_mod=mask_mod, seq_lengths=(meta.max_query_len, num_slots),
                                    compute_q_blocks=False)  # the transpose only serves backward


def _pad_batch(meta: PagedAttentionMetadata, num_tokens: int, batch: int) -> PagedAttentionMetadata:
    """``meta`` with empty sequences (no keys, no queries) appended up to ``batch`` rows."""
    extra = batch - meta.num_seqs
    bt, qsl = meta.block_tables, meta.query_start_loc
    return PagedAttentionMetadata(
        torch.cat([bt, bt.new_zeros(extra, bt.shape[1])]),
        torch.cat([meta.seq_lens, meta.seq_lens.new_zeros(extra)]),
        torch.cat([qsl, qsl.new_full((extra,), num_tokens)]),
        meta.block_size, meta.max_query_len, meta.max_seq_len)


def _flex_static(*args, **kwargs):
    return flex_attention(*args, **kwargs)


def _flex_dynamic(*args, **kwargs):
    return flex_attention(*args, **kwargs)


@functools.cache
def _compiled(static: bool):
    # two wrappers, so the static decode graphs and the dynamic one have separate caches
    if static:
        return torch.compile(_flex_static, dynamic=False)
    return torch.compile(_flex_dynamic, dynamic=True)


def paged_attention_flex(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
    static_decode: bool = True,
) -> torch.Tensor:
    """Paged causal attention through flex_attention; same contract as the reference.

    On CUDA it is compiled. Prefill and mixed batches use one graph with dynamic shapes.
    Decode with ``static_decode`` pads the batch to a power of two (>= 16) and compiles
    static shapes: flex only picks its split-KV decoding kernel for a static batch, and
    the buckets bound the graphs to about six (batch 16..512). On CPU flex runs eagerly,
    a dense math path that scores every cache slot (tests only).

    Returns:
        ``[T, Hq, D]`` in q's dtype.
    """
    global _last_mask
    T = q.shape[0]
    if T == 0 or meta.num_seqs == 0:
        return q.new_empty(q.shape)
    num_slots = k_cache.shape[0]
    static = static_decode and meta.max_query_len == 1
    if _last_mask is None or _last_mask[0] is not meta or _last_mask[1:3] != (num_slots, static):
        padded = meta
        if static:
            padded = _pad_batch(meta, T, max(16, 1 << (meta.num_seqs - 1).bit_length()))
        _last_mask = (meta, num_slots, static, padded, build_block_mask(padded, num_slots))
    padded, block_mask = _last_mask[3], _last_mask[4]
    rows, _ = padded.padded_queries(T)
    qp = q[rows].permute(0, 2, 1, 3)  # [B, Hq, Mq, D]
    k = k_cache.permute(1, 0, 2).unsqueeze(0)  # [1, Hkv, slots, D], a view
    v = v_cache.permute(1, 0, 2).unsqueeze(0)
    if q.is_cuda:
        # key tiles must fit in one cache block: flex's default tile is wider than a block
        o = _compiled(static)(qp, k, v, block_mask=block_mask, scale=scale, enable_gqa=True,
                              kernel_options={"BLOCK_N": meta.block_size})
    else:
        o = flex_attention(qp, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)
    return padded.unpad(o.permute(0, 2, 1, 3), T)
