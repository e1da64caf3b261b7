"""Random paged-attention inputs with shuffled block tables, and a naive dense oracle."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from elasticep.models.paged_attention import PagedAttentionMetadata


@dataclass
class PagedCase:
    """One batch: inputs of ``paged_attention`` plus the host-side lists the oracle uses."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: PagedAttentionMetadata
    scale: float
    tables: list[list[int]]
    lens: list[int]
    qlens: list[int]

    def args(self) -> tuple:
        """Positional arguments of every implementation, in contract order."""
        return (self.q, self.k_cache, self.v_cache, self.meta, self.scale)


def make_case(lens: list[int], qlens: list[int], hq: int, hkv: int, d: int, block_size: int = 16,
              dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0,
              spare_blocks: int = 3, num_blocks: int | None = None) -> PagedCase:
    """Sequences of ``lens`` tokens whose last ``qlens`` are queries; blocks shuffled.

    The block table is padded with a garbage block id past each sequence's blocks, so
    an implementation that reads past ``seq_lens`` gets wrong answers, not zeros.
    ``num_blocks`` fixes the cache size (else the blocks needed plus ``spare_blocks``).
    """
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = num_blocks or sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, o = [], 0
    for nb in need:
        tables.append(perm[o:o + nb])
        o += nb
    max_blocks = max(need) + 1
    bt = torch.full((len(lens), max_blocks), perm[-1], dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    slots = num_blocks * block_size
    k = torch.randn(slots, hkv, d, generator=g).to(dtype)
    v = torch.randn(slots, hkv, d, generator=g).to(dtype)
    T = sum(qlens)
    q = torch.randn(T, hq, d, generator=g).to(dtype)
    qsl = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0).tolist()), dtype=torch.int32)
    dev = torch.device(device)
    meta = PagedAttentionMetadata(bt.to(dev), torch.tensor(lens, dtype=torch.int32, device=dev),
                                  qsl.to(dev), block_size, max(qlens), max(lens))
    return PagedCase(q.to(dev), k.to(dev), v.to(dev), meta, d ** -0.5, tables, list(lens),
                     list(qlens))


def dense_oracle(c: PagedCase) -> torch.Tensor:
    """Per-sequence fp32 attention with an explicit causal mask -> ``[T, Hq, D]`` fp32."""
    hq, hkv = c.q.shape[1], c.k_cache.shape[1]
    outs = []
    o = 0
    for table, n, nq in zip(c.tables, c.lens, c.qlens, strict=True):
        pos = torch.arange(n)
        bs = c.meta.block_size
        slots = torch.tensor(table)[pos // bs] * bs + pos % bs
        k = c.k_cache.cpu()[slots].float().repeat_interleave(hq // hkv, dim=1)  # [n, Hq, D]
        v = c.v_cache.cpu()[slots].float().repeat_interleave(hq // hkv, dim=1)
        q = c.q.cpu()[o:o + nq].float()
        s = torch.einsum("qhd,khd->hqk", q, k) * c.scale
        qpos = torch.arange(n - nq, n)[:, None]
        s = s.masked_fill(pos[None, :] > qpos, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v))
        o += nq
    return torch.cat(outs)
