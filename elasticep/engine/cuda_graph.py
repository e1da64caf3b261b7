"""CUDA graphs of the decode forward pass, one per batch-size bucket.

A decode step in eager mode launches about a hundred kernels per layer from Python, so
at Qwen3-30B-A3B's shape the host, not the GPU, sets the step time. Capturing the
forward once per bucket and replaying it costs a few launches per step.

The capture is piecewise (:mod:`elasticep.engine.piecewise_graph`): an EP executor marks
each token exchange as an eager boundary, so the graphs hold the attention, norms,
router and expert GEMMs, and every collective runs eagerly between them. No graph ever
holds a communicator, and a graph stays valid across a peer's death. A single-rank
executor has no boundary, and its forward is one graph. The capture itself exchanges
nothing (the boundaries run a local stand-in), so each rank captures on its own.

Static buffers hold the step's inputs. A batch of ``B`` sequences runs in the smallest
bucket ``b >= B`` (for EP: ``b >=`` the step's agreed largest batch, so every rank
sizes its exchange alike); the ``b - B`` padding rows decode token 0 at position 0 over
a private *sink* KV block that no sequence owns, and their logits are dropped. The
graph's attention is sized for ``max_seq_len`` keys; the kernels stop at each
sequence's own length, read from the device.

An executor may offer more than one form of the forward (``graph_variants``: the
same-host exchange's form without waits, for a rank with no active peer). Each bucket
is captured in every form after one warm-up, and a replay runs the form the executor
names for the moment (``graph_variant()``).

When the executor's tensors change shape (a placement with more slots per rank), every
bucket is captured again in a background thread while the steps run eagerly, so an
epoch change never waits on a capture; placements of the same shape are copied into the
captured tensors in place and need no capture. The eager steps meanwhile use buffers of
their own (see :mod:`elasticep.moe.cuda_executor`), never the graphs' static ones.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Sequence

import torch

from elasticep.engine.piecewise_graph import PiecewiseCapture, PiecewiseGraph
from elasticep.models.layers import AttentionMetadata
from elasticep.models.model import MoECausalLM
from elasticep.models.paged_attention import PagedAttentionMetadata

logger = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def graph_safe(model: MoECausalLM) -> bool:
    """True when the model's decode forward may be captured: its attention reads no host
    value per step (:attr:`MoECausalLM.graph_capturable`) and its executor has no host
    sync and runs every collective through an eager boundary (``executor.graph_safe``)."""
    return model.graph_capturable and model.executor.graph_safe


def capture_buckets(max_batch: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> list[int]:
    """The batch sizes captured for at most ``max_batch`` sequences (ascending; the last
    is ``max_batch``). Every rank of a deployment derives the same list from the same
    ``cuda_graph_max_bs`` (a function of the deployment's config only,
    :func:`elasticep.engine.limits.cuda_graph_max_bs`), which is what keeps their
    exchange capacities equal."""
    return sorted({b for b in buckets if b <= max_batch} | {max_batch})


def executor_of(model: MoECausalLM):
    """The executor doing the work (a hooks wrapper's ``inner``, else the model's)."""
    return getattr(model.executor, "inner", model.executor)


class DecodeGraphs:
    """Captured decode forwards of ``model`` for each bucket up to ``max_batch``.

    Args:
        model: the model (on a CUDA device).
        kv_layers: per layer ``(k_cache, v_cache)``; their last ``block_size`` slots (block
            ``sink_block``) must belong to no sequence.
        block_size: tokens per KV block.
        sink_block: the block padding rows read and write.
        max_seq_len: the longest context a sequence may reach (tokens); sizes the block
            tables and the attention grid.
        max_batch: the most sequences of a decode step; buckets above it are dropped.
        buckets: batch sizes to capture (ascending).

    Raises:
        ValueError: the model is not on CUDA or its executor is not graph-safe.
    """

    def __init__(self, model: MoECausalLM, kv_layers: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, sink_block: int, max_seq_len: int, max_batch: int,
                 buckets: Sequence[int] = DEFAULT_BUCKETS) -> None:
        if model.device.type != "cuda" or not graph_safe(model):
            raise ValueError("decode CUDA graphs need a CUDA model with a graph-safe executor")
        self.model = model
        self.kv_layers = kv_layers
        self.block_size = block_size
        self.sink_block = sink_block
        self.max_seq_len = max_seq_len
        self.buckets = capture_buckets(max_batch, buckets)
        n = self.buckets[-1]
        self.width = -(-max_seq_len // block_size)
        dev = model.device
        self._ints = torch.zeros(3 * n, dtype=torch.long, device=dev)  # ids, positions, slots
        self._tables = torch.full((n, self.width), sink_block, dtype=torch.int32, device=dev)
        self._seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self._qsl = torch.arange(n + 1, dtype=torch.int32, device=dev)
        # keyed by (bucket, variant)
        self._graphs: dict[tuple[int, str | None], PiecewiseGraph] = {}
        self._logits: dict[tuple[int, str | None], torch.Tensor] = {}
        self._versions: dict[int, int] = {}
        self._last_variant: str | None = None
        self._pool = torch.cuda.graph_pool_handle()
        self._background: threading.Thread | None = None
        self.capture_s = 0.0
        self.captures = 0  # completed captures (start-up included)
        self.replays = 0

    def bucket(self, batch: int) -> int | None:
        """The smallest captured bucket that holds ``batch`` sequences, or None."""
        return next((b for b in self.buckets if b >= batch), None)

    def _views(self, b: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        n = self.buckets[-1]
        paged = PagedAttentionMetadata(self._tables[:b], self._seq_lens[:b], self._qsl[:b + 1],
                                       self.block_size, 1, self.max_seq_len)
        meta = AttentionMetadata(list(range(b + 1)), [1] * b, self._ints[2 * n:2 * n + b], paged)
        return self._ints[:b], self._ints[n:n + b], meta

    def _version(self) -> int:
        return executor_of(self.model).version

    def _key(self, b: int) -> tuple[int, str | None]:
        # the form the executor names, else the plain one (valid in every membership:
        # its waits pass where a peer is inactive), so a missing form costs speed only
        key = (b, executor_of(self.model).graph_variant())
        return key if key in self._graphs else (b, None)

    def capture(self) -> float:
        """Capture every bucket (largest first, one shared memory pool).

        The buffers hold padding rows while capturing, so the warm-up forwards write
        only the sink block. No replay may run meanwhile (they share those buffers): the
        serving thread checks :meth:`stale`, which is true while a capture runs. An EP
        executor's exchange is sized for the bucket being captured.

        Returns:
            The capture time in seconds.
        """
        t0 = time.perf_counter()
        stream = torch.cuda.Stream()
        # after every replay already queued: the old graphs' memory is about to be reused
        stream.wait_stream(torch.cuda.current_stream())
        todo = sorted(self.buckets, reverse=True)
        variants = executor_of(self.model).graph_variants
        # Garbage collected during a capture may hold an older CUDA graph (or another
        # object that frees device resources), whose destruction a capturing stream
        # refuses; that poisons the capture. Collect now, and not while capturing.
        gc.collect()
        gc_was_on = gc.isenabled()
        gc.disable()
        try:
            self._capture_buckets(stream, todo, variants)
        finally:
            if gc_was_on:
                gc.enable()
        stream.synchronize()
        seconds = time.perf_counter() - t0
        self.capture_s += seconds
        self.captures += 1
        pieces = sorted({self._graphs[b, v].num_pieces for b in todo for v in variants})
        forms = "" if variants == (None,) else f"; forms {[v or 'plain' for v in variants]}"
        logger.info("captured decode CUDA graphs for batch sizes %s (%s pieces each%s) in "
                    "%.2fs", self.buckets, pieces, forms, seconds)
        return seconds

    def _capture_buckets(self, stream: torch.cuda.Stream, todo: list[int],
                         variants: Sequence[str | None]) -> None:
        # capture()'s work: each bucket of ``todo`` in every form, on ``stream``
        n = self.buckets[-1]
        with torch.cuda.stream(stream):
            self._ints.zero_()
            self._ints[2 * n:].fill_(self.sink_block * self.block_size)
            self._tables.fill_(self.sink_block)
            self._seq_lens.fill_(1)
            for b in todo:
                for key in [k for k in self._graphs if k[0] == b]:
                    del self._graphs[key], self._logits[key]
                ids, pos, meta = self._views(b)
                for _ in range(2):  # compile kernels and create handles outside the graph
                    with PiecewiseCapture(bound=b):
                        self.model.forward(ids, pos, meta, self.kv_layers)
                # after the warm-ups, which may have grown the exchange buffers (a new
                # version that this capture already points to)
                version = self._version()
                first = None
                for variant in variants:  # never replayed together: one pool serves all
                    with PiecewiseCapture(self._pool, bound=b, variant=variant) as cap:
                        logits = self.model.forward(ids, pos, meta, self.kv_layers)
                        if first is not None:
                            # one output kept for every form: [b, V] float32 is up to
                            # 155 MB a bucket at Qwen3's vocabulary (the later form's own
                            # is freed to the pool after its capture); a copy is a few
                            # us a step.
                            # The forward runs in inference mode, so its outputs are
                            # inference tensors, written to only in that mode.
                            with torch.inference_mode():
                                first.copy_(logits)
                    if first is None:
                        first = logits
                    self._graphs[b, variant], self._logits[b, variant] = cap.result, first
                # the version the tensors had when captured: a change during the capture
                # leaves the bucket stale
                self._versions[b] = version if version == self._version() else -1

    def capture_in_background(self) -> None:
        """Start capturing every bucket in a daemon thread, unless one is running.

        A failed capture is logged and leaves the buckets stale (the steps stay eager).
        """
        if self._background is not None and self._background.is_alive():
            return

        def run() -> None:
            try:
                torch.cuda.set_device(self.model.device)  # the current device is per thread
                with torch.inference_mode():
                    self.capture()
            except Exception as exc:  # noqa: BLE001 - eager is slower, never wrong
                logger.warning("background CUDA graph capture failed; decode stays eager: %s", exc)

        logger.info("executor tensors changed shape: decode runs eagerly while its CUDA "
                    "graphs are captured again in the background")
        self._background = threading.Thread(target=run, name="cuda-graph-capture", daemon=True)
        self._background.start()

    def wait_capture(self, timeout_s: float | None = None) -> bool:
        """Wait for a background capture; True when none is running any more."""
        t = self._background
        if t is not None:
            t.join(timeout_s)
        return t is None or not t.is_alive()

    def stale(self, b: int) -> bool:
        """True when bucket ``b`` cannot be replayed now: no graph, the executor's tensors
        changed shape since its capture, or a capture is running."""
        if self._background is not None and self._background.is_alive():
            return True
        return self._key(b) not in self._graphs or self._versions.get(b) != self._version()

    def replay(self, ids: list[int], positions: list[int], slots: list[int],
               tables: list[list[int]], seq_lens: list[int], min_bucket: int = 0) -> torch.Tensor:
        """Run one decode step of ``B = len(ids)`` sequences through its bucket's graph.

        Args:
            ids, positions, slots: per sequence, the new token, its position and the KV
                slot it writes.
            tables: per sequence, its block ids.
            seq_lens: per sequence, context length after this step (tokens).
            min_bucket: run a bucket of at least this many rows (an EP step's agreed
                largest batch; ``B`` may then be 0).

        Returns:
            ``[B, V]`` float32 logits (a view of the graph's output: read it before the
            next replay).

        Raises:
            ValueError: no bucket holds ``B`` sequences, a context exceeds
                ``max_seq_len``, or the bucket is :meth:`stale`.
        """
        B = len(ids)
        b = self.bucket(max(B, min_bucket))
        longest = max(seq_lens, default=1)
        if b is None or longest > self.max_seq_len:
            raise ValueError(f"decode batch of {max(B, min_bucket)} (longest {longest} tokens) "
                             f"exceeds the captured {self.buckets[-1]} x {self.max_seq_len}")
        if self.stale(b):
            raise ValueError(f"bucket {b} is stale: capture it first (see stale())")
        n = self.buckets[-1]
        pad = b - B
        sink_slot = self.sink_block * self.block_size
        host = torch.tensor([*ids, *[0] * pad, *positions, *[0] * pad, *slots, *[sink_slot] * pad],
                            dtype=torch.long).pin_memory()
        w = max((len(t) for t in tables), default=1)
        rows = [list(t) + [self.sink_block] * (w - len(t)) for t in tables]
        rows += [[self.sink_block] * w] * pad
        lens = torch.tensor([*seq_lens, *[1] * pad], dtype=torch.int32).pin_memory()
        tab = torch.tensor(rows, dtype=torch.int32).pin_memory()
        self._ints[:b].copy_(host[:b], non_blocking=True)
        self._ints[n:n + b].copy_(host[b:2 * b], non_blocking=True)
        self._ints[2 * n:2 * n + b].copy_(host[2 * b:], non_blocking=True)
        self._tables[:b, :w].copy_(tab, non_blocking=True)
        self._seq_lens[:b].copy_(lens, non_blocking=True)
        key = self._key(b)
        if key[1] != self._last_variant:  # a membership change: say which form runs now
            logger.info("decode CUDA graphs: replaying the %s form", key[1] or "plain")
            self._last_variant = key[1]
        self._graphs[key].replay(live_rows=B)  # the rest pad the bucket
        self.replays += 1
        return self._logits[key][:B]
