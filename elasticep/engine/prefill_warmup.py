"""Warm every prefill shape before a rank says it is ready: no compilation on the request path.

The decode CUDA graphs (:mod:`elasticep.engine.cuda_graph`) compile and tune the decode
kernels at start-up, but a prefill or mixed step runs eagerly, and its first run of a
shape pays for whatever is done once per shape: a Triton kernel compiled for a new
specialization of its arguments, cuBLAS picking (and lazily loading) a GEMM kernel for
a new row count, the caching allocator growing to the step's activations. On an H200 a
process's first 8192-token step took 3-8 s and a first 16 x 128 step 0.8-1.0 s, against
65-190 ms warm (docs/results/notes/gpu.md, session 6).

So before its hello (the ready line of ``serve`` waits on it), a rank runs dummy steps
that cover every step it may be given, by a bounded set of buckets
(:func:`warmup_plan`):

- token counts: every power of two up to the step budget (``--chunked-prefill-size``),
  and the budget itself, as the scheduler packs any count in between;
- per count, the compositions that take different kernels: one whole prompt (SDPA's
  flash kernel from :data:`~elasticep.models.layers.FLASH_PREFILL_MIN_SEQ_TOKENS` tokens,
  the paged Triton kernel below), two long prompts, many short prompts of
  :data:`SHORT_PROMPT` tokens (the paged kernel), and a chunk over a cached prefix
  beside running decodes (a mixed step of chunked prefill).

The kernels' compiled forms do not depend on the batch beyond these classes: row counts
reach the Triton kernels only as grid sizes, and the block tables are laid out so that
their specialization is the same for every batch
(:meth:`~elasticep.models.paged_attention.PagedAttentionMetadata.from_lists`).

The steps run through the engine's own :meth:`~elasticep.engine.llm_engine.LLMEngine.execute`
(forward and sampling) on KV blocks borrowed from its free pool and given back, and
change no request state. They run on CUDA only; elsewhere (the CPU test deployments)
:func:`warm_up_prefill` returns at once. ``serve --skip-server-warmup`` (SGLang's flag)
turns it off.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch

from elasticep.engine.llm_engine import LLMEngine
from elasticep.engine.request import SamplingParams
from elasticep.engine.scheduler import ScheduledBatch, ScheduledSeq
from elasticep.engine.sequence import Sequence
from elasticep.models.layers import FLASH_PREFILL_MIN_SEQ_TOKENS

logger = logging.getLogger(__name__)

# the prompt length of the many-short-prompts composition (16 x 128 in the table)
SHORT_PROMPT = 128
# running decodes beside the chunk of a mixed step
MIXED_DECODES = 8
# the step budget when the engine does not chunk prefills
DEFAULT_BUDGET = 8192


def token_buckets(budget: int) -> list[int]:
    """The token counts warmed for a step budget: 1, 2, 4, ... below ``budget``, then
    ``budget`` (ascending, no repeats).

    Raises:
        ValueError: ``budget`` below 1.
    """
    if budget < 1:
        raise ValueError(f"the step budget must be >= 1 token, got {budget}")
    out, n = [], 1
    while n < budget:
        out.append(n)
        n *= 2
    return [*out, budget]


@dataclass(frozen=True)
class WarmupStep:
    """One dummy step: sequence ``i`` has ``cached[i]`` tokens in the cache and computes
    ``new[i]`` more (``cached[i] == 0``: a whole prompt)."""

    new: tuple[int, ...]
    cached: tuple[int, ...]
    kind: str

    @property
    def num_tokens(self) -> int:
        """Tokens the forward processes."""
        return sum(self.new)

    @property
    def kv_tokens(self) -> int:
        """KV-cache tokens the step's sequences hold."""
        return sum(self.new) + sum(self.cached)


def _step(kind: str, new: list[int], cached: list[int] | None = None) -> WarmupStep:
    return WarmupStep(tuple(new), tuple(cached or [0] * len(new)), kind)


def compositions(tokens: int, flash_min: int = FLASH_PREFILL_MIN_SEQ_TOKENS,
                 short: int = SHORT_PROMPT, decodes: int = MIXED_DECODES) -> list[WarmupStep]:
    """The steps of ``tokens`` new tokens that take different kernels (see the module doc).

    Args:
        tokens: T, new tokens of each step.
        flash_min: prompts of at least this many tokens take SDPA's flash kernel.
        short: prompt length of the many-short-prompts step.
        decodes: one-token sequences beside the chunk of the mixed step.

    Returns:
        ``one`` (a whole prompt of T); ``two_long`` (two of T/2, when those take the flash
        kernel); ``short`` (prompts of ``short`` tokens, the last one shorter, when T
        holds two); ``mixed`` (a chunk of T - decodes tokens over a cached prefix of as
        many, plus ``decodes`` decoding sequences of ``short`` cached tokens, when T >
        2 * decodes).
    """
    steps = [_step("one", [tokens])]
    if tokens // 2 >= flash_min:
        steps.append(_step("two_long", [tokens // 2, tokens - tokens // 2]))
    if tokens >= 2 * short:
        lens = [short] * (tokens // short) + ([tokens % short] if tokens % short else [])
        steps.append(_step("short", lens))
    if tokens > 2 * decodes:
        chunk = tokens - decodes
        steps.append(_step("mixed", [chunk] + [1] * decodes, [chunk] + [short] * decodes))
    return steps


def warmup_plan(budget: int, kv_tokens: int, **kw: int) -> list[WarmupStep]:
    """Every step :func:`warm_up_prefill` runs for a step budget, smallest first.

    Args:
        budget: most prefill tokens of one step (the engine's ``chunked_prefill_size``).
        kv_tokens: the KV-cache tokens free for the warm-up; steps that need more are
            left out (a cache that small never holds such a step).
        kw: :func:`compositions`' tuning arguments.

    Returns:
        ``[WarmupStep]``, for each of :func:`token_buckets` its :func:`compositions`.
    """
    return [s for n in token_buckets(budget) for s in compositions(n, **kw)
            if s.kv_tokens <= kv_tokens]


def step_budget(engine: LLMEngine) -> int:
    """The most tokens one step of ``engine`` may hold: its chunk size (or
    :data:`DEFAULT_BUDGET` without chunking), within the scheduler's per-step token
    budget (``max_batch_tokens``, decodes included) and the longest sequence."""
    budget = engine.config.chunked_prefill_size or DEFAULT_BUDGET
    return max(1, min(budget, engine.config.max_batch_tokens, engine.max_seq_len - 1))


def engine_plan(engine: LLMEngine) -> list[WarmupStep]:
    """:func:`warmup_plan` for ``engine``'s :func:`step_budget` and free KV cache."""
    free = engine.blocks.num_free_blocks * engine.blocks.block_size
    return warmup_plan(step_budget(engine), free)


def _batch(engine: LLMEngine, step: WarmupStep, vocab: int) -> ScheduledBatch:
    """``step`` as a batch of dummy sequences with KV blocks taken from the free pool."""
    items = []
    # greedy and sampled rows alike (the sampler's two paths)
    params = [SamplingParams(max_tokens=2, ignore_eos=True, temperature=t) for t in (0.0, 1.0)]
    for i, (new, cached) in enumerate(zip(step.new, step.cached, strict=True)):
        n = cached + new
        prompt = [(7 + 31 * (i + p)) % vocab for p in range(n)]
        seq = Sequence(f"__warmup_{i}__", prompt, [], params[i % 2], -1)
        engine.blocks.grow(seq.block_table, n)
        items.append(ScheduledSeq(seq, cached, n))
    return ScheduledBatch(tuple(items))


@dataclass
class WarmupReport:
    """What :func:`warm_up_prefill` did.

    Attributes:
        steps: dummy steps run.
        seconds: wall time, the GPU synchronized at the end.
        triton_compiles: Triton kernels compiled meanwhile (None where Triton has no
            compile hook).
        token_counts: the step token counts warmed (:func:`token_buckets`, capped).
    """

    steps: int = 0
    seconds: float = 0.0
    triton_compiles: int | None = None
    token_counts: list[int] = field(default_factory=list)


StepContext = Callable[[int], AbstractContextManager]


def run_warmup(engine: LLMEngine, steps: list[WarmupStep],
               around: StepContext | None = None) -> WarmupReport:
    """Run ``steps`` through ``engine.execute``; each borrows KV blocks and gives them back.

    Args:
        engine: the rank's engine, before any request (its cache rows are overwritten).
        steps: from :func:`warmup_plan`.
        around: ``around(num_tokens)`` is entered around each step's execute (an EP
            rank's: the step's token bound, exchanges kept local), or None.

    Returns:
        The :class:`WarmupReport`.
    """
    report = WarmupReport(token_counts=sorted({s.num_tokens for s in steps}))
    vocab = engine.model.config.vocab_size
    t0 = time.perf_counter()
    # every step eager: a short one would otherwise replay a decode graph, which warms
    # nothing for the steps that run eagerly (while graphs are captured again), and
    # whose exchange would wait on peers that are not in this rank's warm-up
    runner = engine.runner
    replay, runner.replay_enabled = runner.replay_enabled, False
    try:
        with count_triton_compiles() as compiles:
            for step in steps:
                batch = _batch(engine, step, vocab)
                try:
                    with around(step.num_tokens) if around else contextlib.nullcontext():
                        engine.execute(batch)
                finally:
                    for it in batch.items:
                        engine.blocks.free(it.seq.block_table)
                report.steps += 1
            if engine.model.device.type == "cuda":
                torch.cuda.synchronize(engine.model.device)
    finally:
        runner.replay_enabled = replay
    report.seconds = time.perf_counter() - t0
    report.triton_compiles = compiles.count
    return report


def warm_up_prefill(engine: LLMEngine, around: StepContext | None = None,
                    skip: bool = False) -> WarmupReport | None:
    """Warm every prefill shape of ``engine``'s step budget (see the module doc); logs
    the time taken.

    Args:
        engine: a new engine (no request added yet) whose model's executor has all its
            experts.
        around: as :func:`run_warmup`.
        skip: do nothing (``--skip-server-warmup``, or a joiner, whose experts arrive
            later).

    Returns:
        The report, or None when skipped or not on CUDA.
    """
    if skip or engine.model.device.type != "cuda":
        return None
    with torch.inference_mode():
        report = run_warmup(engine, engine_plan(engine), around)
    logger.info("prefill warm-up: %d steps of %d-%d tokens in %.2fs (%s Triton compiles)",
                report.steps, report.token_counts[0], report.token_counts[-1],
                report.seconds, report.triton_compiles)
    return report


class _CompileCount:
    """A count of Triton compilations (``count`` None when Triton offers no hook)."""

    def __init__(self) -> None:
        self.count: int | None = None
        self.names: list[str] = []

    def hook(self, *args: object, **kwargs: object) -> bool:
        self.count = (self.count or 0) + 1
        self.names.append(str(kwargs.get("repr", ""))[:120])
        return False  # go on compiling


@contextlib.contextmanager
def count_triton_compiles() -> Iterator[_CompileCount]:
    """Count the Triton kernels compiled (in-memory cache misses) within the body.

    Uses ``triton.knobs.runtime.jit_cache_hook`` (Triton >= 3.4), else
    ``JITFunction.cache_hook``; without Triton or either hook the count stays None. An
    existing hook is restored after.
    """
    counter = _CompileCount()
    try:
        import triton
    except ImportError:
        yield counter
        return
    knobs = getattr(getattr(triton, "knobs", None), "runtime", None)
    owner, name = ((knobs, "jit_cache_hook") if knobs is not None and hasattr(knobs, "jit_cache_hook")
                   else (triton.runtime.jit.JITFunction, "cache_hook"))
    if not hasattr(owner, name):
        yield counter
        return
    before = getattr(owner, name)
    counter.count = 0
    setattr(owner, name, counter.hook)
    try:
        yield counter
    finally:
        setattr(owner, name, before)
