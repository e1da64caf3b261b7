"""Turn a scheduled batch into one forward pass over the paged KV cache.

``forward`` reads request state but never mutates it; its only side effect is writing
K/V to the slots of the scheduled positions, which a redo rewrites identically.

A step of few tokens replays a decode CUDA graph even when it carries prefill: every
token becomes a row of its own, with its sequence's block table and a context that
ends at its own position. The graph writes the step's K/V to the cache before its
attention reads it (as the eager forward does), so row ``i`` of a chunk sees rows
``0..i`` of the same chunk, which is causal prefill. Such a step run eagerly is bound
by the host (about 90 kernels a layer, launched one by one), which is most of a short
prompt's first token.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from itertools import pairwise

import torch

from elasticep.engine.cuda_graph import DecodeGraphs, capture_buckets, executor_of, graph_safe
from elasticep.engine.kv_cache import KVCache
from elasticep.engine.scheduler import ScheduledBatch
from elasticep.models.layers import AttentionMetadata
from elasticep.models.model import MoECausalLM
from elasticep.models.paged_attention import PagedAttentionMetadata

logger = logging.getLogger(__name__)


@dataclass
class HostLists:
    """A batch's per-token and per-sequence ints, gathered on the host in one pass.

    ids, positions, slots: [T] token id, position and KV-cache slot of each scheduled
    token; starts: [B + 1] first token of each sequence (then T); ctx_lens: [B] tokens
    in context after this step; tables: [B] block tables.
    """

    ids: list[int]
    positions: list[int]
    slots: list[int]
    starts: list[int]
    ctx_lens: list[int]
    tables: list[list[int]]

    @classmethod
    def of(cls, batch: ScheduledBatch, block_size: int) -> HostLists:
        h = cls([], [], [], [0], [], [])
        bs = block_size
        for it in batch.items:
            seq, table = it.seq, it.seq.block_table
            if it.end - it.start == 1:  # a decode
                p = it.start
                h.ids.append(seq.token_at(p))
                h.positions.append(p)
                h.slots.append(table[p // bs] * bs + p % bs)
            else:  # a prefill chunk: slices and one range a block, not a loop a token (that
                # loop was part of the 7.6 ms an H200 waited for an 8192-token step's first
                # kernel)
                h.ids.extend(seq.all_token_ids[it.start:it.end])
                h.positions.extend(range(it.start, it.end))
                for b in range(it.start // bs, (it.end - 1) // bs + 1):
                    lo, hi = max(it.start, b * bs), min(it.end, (b + 1) * bs)
                    h.slots.extend(range(table[b] * bs + lo - b * bs, table[b] * bs + hi - b * bs))
            h.starts.append(h.starts[-1] + it.end - it.start)
            h.ctx_lens.append(it.end)
            h.tables.append(table)
        return h

    def last_rows(self, samples: list[bool]) -> list[int]:
        """The token index of the last token of each sequence whose ``samples`` entry
        (one per sequence, batch order) is true: the rows whose logits are sampled."""
        return [z - 1 for z, s in zip(self.starts[1:], samples, strict=True) if s]


# Past this many block-table entries (tokens x the step's widest table), the table of a
# rows replay, built on the host one row a token, costs more than the eager step's
# launches it would save (a 200-token chunk after an 8192-token prefix, about 100,000
# entries, took about 12 ms to build on a 2-core host).
ROW_TABLE_ENTRIES_MAX = 32768


def rows_replay_pays(num_tokens: int, tables: list[list[int]]) -> bool:
    """True when a step of ``num_tokens`` tokens over sequences with block ``tables``
    should replay as one row a token (pure): its per-token table stays small."""
    return num_tokens * max((len(t) for t in tables), default=0) <= ROW_TABLE_ENTRIES_MAX


def token_rows(h: HostLists) -> tuple[list[list[int]], list[int]]:
    """A step as one decode row a token (pure).

    Returns:
        ``(tables, lens)``: per token of ``h``, its sequence's block table and its
        context length (its position + 1: it attends to the cache up to itself).
    """
    tables: list[list[int]] = []
    for table, a, z in zip(h.tables, h.starts, h.starts[1:], strict=False):
        tables.extend([table] * (z - a))
    return tables, [p + 1 for p in h.positions]


class ModelRunner:
    """Owns the KV cache tensors of one model and runs batches through the model.

    Args:
        model: the loaded model.
        num_blocks, block_size: KV-cache geometry (capacity = product, in tokens). One
            more block is allocated as the CUDA graphs' sink (:mod:`cuda_graph`).
    """

    def __init__(self, model: MoECausalLM, num_blocks: int, block_size: int) -> None:
        self.model = model
        self.sink_block = num_blocks  # never lent by the BlockManager
        self.kv_cache = KVCache(
            model.config.num_hidden_layers, num_blocks + 1, block_size, model.kv_cache_shapes(),
            model.dtype, model.device,
        )
        self.graphs: DecodeGraphs | None = None
        # forwards of decode steps (see _decode_step; a redone step counts again) that
        # replayed a captured graph, and that ran eagerly: no graph, a stale bucket (a
        # capture running), a batch or context past the captured sizes, or all logits
        self.decode_replays = 0
        self.decode_eager = 0
        # steps with prefill tokens replayed as one row a token (see the module doc)
        self.prefill_replays = 0
        # False: no step replays a graph (a warm-up, whose steps run on this rank's own
        # schedule and must compile the eager kernels)
        self.replay_enabled = True

    @property
    def graph_captures(self) -> int | None:
        """Complete decode-graph captures since start (start-up included); None when this
        runner has no decode graphs (CPU, ``--disable-cuda-graph``, a capture that
        failed)."""
        return None if self.graphs is None else self.graphs.captures

    def enable_cuda_graphs(self, max_batch: int, max_seq_len: int) -> float | None:
        """Capture decode graphs when the model allows it (CUDA, graph-safe executor).

        An EP executor also learns the buckets here (``token_buckets``), whether or not
        the capture succeeds: every rank then rounds a step's exchange capacity up to
        the same bucket, so eager ranks and replaying ranks exchange alike.

        Returns:
            The capture time in seconds, or None when the model cannot be captured (or
            the capture failed: that is logged, and decode runs eagerly).
        """
        ex = executor_of(self.model)
        ex.token_buckets = tuple(capture_buckets(max_batch))
        ex.refresh()
        if self.model.device.type != "cuda" or not graph_safe(self.model):
            return None
        graphs = DecodeGraphs(self.model, self.kv_cache.layers, self.kv_cache.block_size,
                              self.sink_block, max_seq_len, max_batch)
        try:
            seconds = graphs.capture()
        except RuntimeError as exc:  # a capture-unsafe op: eager is slower, never wrong
            logger.warning("decode CUDA graph capture failed, running eagerly: %s", exc)
            return None
        self.graphs = graphs
        return seconds

    @staticmethod
    def _decode_step(batch: ScheduledBatch) -> bool:
        """True for a step of at least one sequence in which every sequence decodes one
        token and samples it (a prefill chunk, even a 1-token one that samples nothing,
        is not a decode step). An idle EP rank's empty step is none (it may replay a
        graph all the same, counted in ``graphs.replays`` only)."""
        return batch.one_token_each and all(it.samples for it in batch.items)

    def _replay(self, batch: ScheduledBatch, decode: bool) -> torch.Tensor | None:
        """The step through a captured graph, or None when it must run eagerly
        (``decode``: :meth:`_decode_step` of ``batch``).

        A decode step replays one row a sequence; a step with prefill tokens, when its
        tokens fit a bucket, one row a token (the module doc), returning the rows of
        the sequences that sample, in batch order."""
        g = self.graphs
        # An EP step's bucket follows the largest batch of any rank (agreed in the step
        # header), so an idle rank replays too; a single rank has no such bound.
        agreed = executor_of(self.model).step_max_tokens or 0
        if (g is None or not self.replay_enabled or not (batch.items or agreed)
                or not graph_safe(self.model)):
            return None
        # the bucket first: a step past the largest one builds its host lists once, in
        # prepare()
        b = g.bucket(max(batch.num_tokens, agreed))
        if b is None:
            return None
        if g.stale(b):
            g.capture_in_background()  # never wait on a capture: this step runs eagerly
            return None
        h = HostLists.of(batch, self.kv_cache.block_size)
        if decode or not batch.items:
            if max(h.ctx_lens, default=0) > g.max_seq_len:
                return None
            return g.replay(h.ids, h.positions, h.slots, h.tables, h.ctx_lens,
                            min_bucket=agreed)
        if not rows_replay_pays(len(h.ids), h.tables):
            return None
        tables, lens = token_rows(h)
        if max(lens) > g.max_seq_len:
            return None
        logits = g.replay(h.ids, h.positions, h.slots, tables, lens, min_bucket=agreed)
        self.prefill_replays += 1
        rows = torch.tensor(h.last_rows([it.samples for it in batch.items]), dtype=torch.long)
        if rows.device != logits.device:
            rows = rows.pin_memory().to(logits.device, non_blocking=True)
        return logits.index_select(0, rows)

    def prepare(
        self, batch: ScheduledBatch
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Build ``(input_ids [T], positions [T], meta, last_token_rows [N])`` for ``batch``:
        the logits rows are the last tokens of the N sequences that sample this step
        (a prefill chunk that leaves part of its prompt for later has none).

        Everything is computed in host lists and reaches the device in two copies (the
        token-indexed ints, and the block tables); a per-sequence tensor would cost a
        launch or a copy per sequence per step.
        """
        dev = self.model.device
        if not batch.items:  # an idle EP rank still runs every layer (empty dispatch)
            empty = torch.zeros(0, dtype=torch.long, device=dev)
            return empty, empty, AttentionMetadata([0], [], empty), empty
        bs = self.kv_cache.block_size
        h = HostLists.of(batch, bs)
        T = len(h.ids)
        last = h.last_rows([it.samples for it in batch.items])
        host = torch.tensor(h.ids + h.positions + h.slots + last, dtype=torch.long)
        if dev.type == "cuda":
            host = host.pin_memory()
        flat = host.to(dev, non_blocking=True)
        query_lens = [b - a for a, b in pairwise(h.starts)]
        paged = PagedAttentionMetadata.from_lists(h.tables, h.ctx_lens, query_lens, bs, dev)
        meta = AttentionMetadata(h.starts, h.ctx_lens, flat[2 * T:3 * T], paged)
        return flat[:T], flat[T:2 * T], meta, flat[3 * T:]

    def forward(self, batch: ScheduledBatch, all_logits: bool = False) -> torch.Tensor:
        """Run ``batch``; return float32 logits ``[N, V]`` of the last token of each
        sequence that samples this step, in batch order (or ``[T, V]`` for every
        scheduled token when ``all_logits``)."""
        decode = self._decode_step(batch)
        if not all_logits:
            logits = self._replay(batch, decode)
            if logits is not None:
                self.decode_replays += decode
                return logits
        self.decode_eager += decode
        input_ids, positions, meta, last = self.prepare(batch)
        return self.model.forward(
            input_ids, positions, meta, self.kv_cache.layers, None if all_logits else last
        )

    def forward_rows(self, batch: ScheduledBatch, rows: list[int]) -> torch.Tensor:
        """Run ``batch`` eagerly; return float32 logits ``[len(rows), V]`` of the scheduled
        tokens at the flat indices ``rows`` (prompt scoring: only those rows go through
        the LM head)."""
        self.decode_eager += self._decode_step(batch)
        input_ids, positions, meta, _ = self.prepare(batch)
        idx = torch.tensor(rows, dtype=torch.long)
        if self.model.device.type == "cuda":
            idx = idx.pin_memory()
        return self.model.forward(input_ids, positions, meta, self.kv_cache.layers,
                                  idx.to(self.model.device, non_blocking=True))

