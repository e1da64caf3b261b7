"""Where a profiled window of steps spent its time: a JSON-able summary.

Input: what a finished ``torch.profiler.profile`` recorded over ``steps`` steps, plus
the steps' wall time measured by the caller. Output: per step, the wall time, the GPU
busy time (the union of kernel intervals, so overlapping streams count once), the host
gap (wall minus busy: time the GPU had nothing to run, i.e. host work, launches, waits
on the CPU side), the kernel count, GPU time by kind, the top kernels by time, and the
top host-side events (ops, ``record_function`` ranges, CUDA runtime calls) by their
inclusive time, which tell what the host did in the gaps.

Kinds are guessed from kernel names, so they are coarse: ``experts`` takes every GEMM
and GEMV (cuBLAS and Triton names cannot tell an expert GEMM from the attention
projections or the LM head), ``attention`` takes softmax too (the router's as well),
``exchange`` is the NCCL / all-to-all kernels, whose time includes waiting in the
kernel for the peer rank (so a rank that arrives early shows a long exchange), and
``other`` the rest (norms, RoPE, casts, copies, memsets). Used by the serving ranks'
profiler (:mod:`elasticep.elastic.step_profiler`) and by ``bench/scale.py``.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

# First match wins, in this order; every name is matched lower-cased.
KERNEL_KINDS: dict[str, tuple[str, ...]] = {
    "attention": ("attn", "sdpa", "flash", "fmha", "paged", "softmax"),
    "experts": ("grouped", "gemm", "gemv", "cutlass", "sm90", "matmul", "nvjet", "mm"),
    "exchange": ("nccl", "alltoall", "all_to_all"),
    "sampling": ("argmax", "topk", "sort", "gumbel", "multinomial"),
}
OTHER = "other"
TOP = 25  # rows of each top list
NAME_CHARS = 80  # names (templated C++ kernels) are cut to this length
STEP_MARK = "ProfilerStep#"  # the profiler's own per-step range: not host work


@dataclass(frozen=True)
class Span:
    """One recorded interval: a device activity (kernel, memcpy, memset) or a host event.

    Attributes:
        name: as the profiler reports it.
        start_us, end_us: its interval on the profiler's clock (microseconds).
    """

    name: str
    start_us: float
    end_us: float


def kernel_kind(name: str) -> str:
    """The kind (a key of :data:`KERNEL_KINDS`, or ``"other"``) of a kernel name."""
    low = name.lower()
    return next((k for k, keys in KERNEL_KINDS.items() if any(x in low for x in keys)), OTHER)


def _split(events: Iterable[tuple[str, Any, float, float, bool]]
           ) -> tuple[list[Span], list[Span]]:
    """(name, device type, start us, end us, is a GPU-projected annotation) ->
    (device spans, host spans)."""
    cuda = torch.autograd.DeviceType.CUDA
    device, host = [], []
    for name, dev, start, end, annotation in events:
        if dev == cuda:
            # a record_function range projected onto the GPU timeline (ProfilerStep#N,
            # c10d's nccl:all_to_all) spans kernels; it is not one
            if not annotation:
                device.append(Span(name, start, end))
        elif not name.startswith(STEP_MARK):
            host.append(Span(name, start, end))
    return device, host


def event_spans(events: Iterable[Any]) -> tuple[list[Span], list[Span]]:
    """(device spans, host spans) of a profiler's parsed events (``prof.events()``).

    Device spans are the kernels, memcpys and memsets (not GPU user annotations); host
    spans are every CPU-side event but the profiler's ``ProfilerStep#N`` ranges. A
    CPU-only profile has no device spans.
    """
    return _split((ev.name, ev.device_type, float(ev.time_range.start),
                   float(ev.time_range.end), bool(getattr(ev, "is_user_annotation", False)))
                  for ev in events)


def profile_spans(prof: torch.profiler.profile) -> tuple[list[Span], list[Span]]:
    """:func:`event_spans` of a finished profiler, read from its raw Kineto results.

    ``prof.events()`` builds a Python object (and an op tree) for every event: about
    11 s for 300k events on a loaded 2-core CPU, against 0.3 s for the raw results,
    and a rank pauses every other rank while it summarises. The raw results are not
    public API, so where this torch lacks them it falls back to ``prof.events()``.
    """
    results = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if results is not None:
        try:
            return _split((e.name(), e.device_type(), e.start_ns() / 1e3,
                           (e.start_ns() + e.duration_ns()) / 1e3, e.is_user_annotation())
                          for e in results.events())
        except AttributeError:  # another torch's event API: the public path below
            pass
    return event_spans(prof.events())


def busy_us(spans: Iterable[Span]) -> float:
    """Length of the union of the spans' intervals (microseconds)."""
    total, end = 0.0, None
    for s in sorted(spans, key=lambda k: k.start_us):
        if end is None or s.start_us > end:
            total += s.end_us - s.start_us
            end = s.end_us
        elif s.end_us > end:
            total += s.end_us - end
            end = s.end_us
    return total


def _top(spans: Iterable[Span], steps: int) -> list[list]:
    """``[name, ms per step, count per step]`` of the ``TOP`` names with the most time."""
    by_name: dict[str, list[float]] = {}
    for s in spans:
        acc = by_name.setdefault(s.name, [0.0, 0])
        acc[0] += s.end_us - s.start_us
        acc[1] += 1
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:TOP]
    return [[name[:NAME_CHARS], round(us / 1e3 / steps, 3), round(n / steps, 1)]
            for name, (us, n) in top]


def idle_gaps(kernels: Iterable[Span], steps: int, top: int = 12) -> dict[str, Any]:
    """Where the GPU sat idle inside a window: its gaps, by the activities around them.

    A gap is a stretch between the end of the union of the spans so far and the next
    span's start. Each is charged to the pair (the span that ended last before it, the
    span after it), so a graph's stream wait shows as the gap between the kernel that
    precedes the wait and the one after it, and the host's time between two steps as
    the gap between one step's last kernel and the next step's first.

    Args:
        kernels: device spans (microsecond clock), in any order.
        steps: steps in the window (>= 1), to give the sums per step.
        top: how many pairs to list.

    Returns:
        ``idle_ms_per_step`` (all gaps, ms per step), ``longest_gaps_ms_per_step`` (the
        ``steps`` longest gaps' sum per step: the between-step share when each step has
        one long gap), and ``idle_by_neighbours_ms_per_step``: up to ``top``
        ``["prev -> next", ms per step, count per step, mean us]``, most idle first.
    """
    spans = sorted(kernels, key=lambda k: k.start_us)
    gaps: list[tuple[float, str, str]] = []
    last: Span | None = None
    for s in spans:
        if last is not None and s.start_us > last.end_us:
            gaps.append((s.start_us - last.end_us, last.name, s.name))
        if last is None or s.end_us > last.end_us:
            last = s
    by_pair: dict[str, list[float]] = {}
    for us, prev, nxt in gaps:
        acc = by_pair.setdefault(f"{prev[:NAME_CHARS // 2]} -> {nxt[:NAME_CHARS // 2]}",
                                 [0.0, 0])
        acc[0] += us
        acc[1] += 1
    longest = sorted((g[0] for g in gaps), reverse=True)[:steps]
    rows = sorted(by_pair.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "idle_ms_per_step": round(sum(g[0] for g in gaps) / 1e3 / steps, 3),
        "longest_gaps_ms_per_step": round(sum(longest) / 1e3 / steps, 3),
        "idle_by_neighbours_ms_per_step": [
            [pair, round(us / 1e3 / steps, 3), round(n / steps, 1), round(us / n, 2)]
            for pair, (us, n) in rows],
    }


def launch_delays(kernels: Iterable[Span], host: Iterable[Span],
                  launch: str = "cudaGraphLaunch") -> dict[str, Any] | None:
    """How long a graph launch took on the host, and how soon the GPU started on it.

    For each host span named ``launch``, the delay is from its start to the first
    device span that starts after it (the profiler aligns the two clocks). Spans are
    not matched by correlation id: while the GPU still runs earlier work, that work's
    next kernel counts, so the delay is then understated. The mean is over the
    launches with a kernel after them.

    Returns:
        None without such spans, else ``launches``, ``launch_host_ms`` (the mean host
        duration) and ``launch_to_gpu_ms`` (the mean delay), both in milliseconds.
    """
    starts = sorted(k.start_us for k in kernels)
    calls = [h for h in host if h.name == launch]
    if not calls or not starts:
        return None
    delays = []
    for h in calls:
        i = bisect.bisect_left(starts, h.start_us)
        if i < len(starts):
            delays.append(starts[i] - h.start_us)
    n = len(calls)
    return {"launches": n,
            "launch_host_ms": round(sum(h.end_us - h.start_us for h in calls) / 1e3 / n, 3),
            "launch_to_gpu_ms": round(sum(delays) / 1e3 / max(len(delays), 1), 3)}


def summarize_spans(kernels: list[Span], steps: int, wall_s: float,
                    host: list[Span] | None = None) -> dict[str, Any]:
    """Per-step figures of a window of ``steps`` steps.

    Args:
        kernels: every device activity recorded in the window.
        steps: how many steps the window holds (>= 1).
        wall_s: their wall time, summed (seconds).
        host: the window's host-side events (None: no ``host_top_ms_per_step``).

    Returns:
        A JSON-able dict (times in milliseconds per step, rounded to 3 decimals):
        ``steps``, ``step_wall_ms``, ``gpu_busy_ms_per_step``, ``host_gap_ms_per_step``,
        ``kernels_per_step`` (a count over steps), ``gpu_ms_per_step_by_kind`` (the
        kinds of :data:`KERNEL_KINDS` plus ``other``), ``nccl_ms_per_step`` (the NCCL
        kernels of the ``exchange`` kind), ``top_kernels_ms_per_step`` and
        ``host_top_ms_per_step`` (up to 25 ``[name, ms per step, count per step]``,
        slowest first; host times are inclusive, so nested events overlap), the keys
        of :func:`idle_gaps`, and ``graph_launch`` (:func:`launch_delays`, with host
        events that hold a graph launch).

    Raises:
        ValueError: ``steps`` < 1 or a negative ``wall_s``.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if wall_s < 0:
        raise ValueError(f"wall_s must be >= 0 seconds, got {wall_s}")
    by_kind = dict.fromkeys([*KERNEL_KINDS, OTHER], 0.0)
    nccl_us = 0.0
    for s in kernels:
        by_kind[kernel_kind(s.name)] += s.end_us - s.start_us
        if "nccl" in s.name.lower():
            nccl_us += s.end_us - s.start_us
    wall_ms = wall_s * 1e3 / steps
    busy_ms = busy_us(kernels) / 1e3 / steps
    row = {
        "steps": steps,
        "step_wall_ms": round(wall_ms, 3),
        "gpu_busy_ms_per_step": round(busy_ms, 3),
        "host_gap_ms_per_step": round(wall_ms - busy_ms, 3),
        "kernels_per_step": round(len(kernels) / steps, 1),
        "gpu_ms_per_step_by_kind": {k: round(v / 1e3 / steps, 3) for k, v in by_kind.items()},
        "nccl_ms_per_step": round(nccl_us / 1e3 / steps, 3),
        "top_kernels_ms_per_step": _top(kernels, steps),
        **idle_gaps(kernels, steps),
    }
    if host is not None:
        row["host_top_ms_per_step"] = _top(host, steps)
        launches = launch_delays(kernels, host)
        if launches is not None:
            row["graph_launch"] = launches
    return row


def summarize_profile(prof: torch.profiler.profile, steps: int, wall_s: float
                      ) -> dict[str, Any]:
    """:func:`summarize_spans` of a finished (stopped) profiler, host events included.

    Args:
        prof: a ``torch.profiler.profile`` after ``stop()`` (or inside its
            ``on_trace_ready``), that recorded exactly the ``steps`` steps.
        steps: steps in the window (>= 1).
        wall_s: their wall time, summed (seconds).

    Raises:
        ValueError: as :func:`summarize_spans`.
    """
    kernels, host = profile_spans(prof)
    return summarize_spans(kernels, steps, wall_s, host)
