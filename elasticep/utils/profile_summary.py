"""Where a profiled window of steps spent its time: a JSON-able summary of GPU kernels.

Input: the device (CUDA) activities a finished ``torch.profiler.profile`` recorded over
``steps`` steps, plus the steps' wall time measured by the caller. Output: per step,
the wall time, the GPU busy time (the union of kernel intervals, so overlapping
streams count once), the host gap (wall minus busy: time the GPU had nothing to run,
i.e. host work, launches, waits on the CPU side), the kernel count, GPU time by kind
and the top kernels by time.

Kinds are guessed from kernel names, so they are coarse: ``experts`` takes every GEMM
and GEMV (cuBLAS and Triton names cannot tell an expert GEMM from the attention
projections or the LM head), ``attention`` takes softmax too (the router's as well),
``exchange`` is the NCCL / all-to-all kernels, whose time includes waiting in the
kernel for the peer rank (so a rank that arrives early shows a long exchange), and
``other`` the rest (norms, RoPE, casts, copies, memsets). Used by the serving ranks'
profiler (:mod:`elasticep.elastic.step_profiler`) and by ``bench/scale.py``.
"""

from __future__ import annotations

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
TOP_KERNELS = 15
NAME_CHARS = 80  # kernel names (templated C++) are cut to this length


@dataclass(frozen=True)
class KernelSpan:
    """One device activity (kernel, memcpy or memset) on the GPU timeline.

    Attributes:
        name: the kernel's name as the profiler reports it.
        start_us, end_us: its interval on the profiler's clock (microseconds).
    """

    name: str
    start_us: float
    end_us: float


def kernel_kind(name: str) -> str:
    """The kind (a key of :data:`KERNEL_KINDS`, or ``"other"``) of a kernel name."""
    low = name.lower()
    return next((k for k, keys in KERNEL_KINDS.items() if any(x in low for x in keys)), OTHER)


def kernel_spans(events: Iterable[Any]) -> list[KernelSpan]:
    """The device activities among a profiler's parsed events (``prof.events()``).

    CPU ops are skipped, and so are GPU user annotations (a ``record_function`` range,
    such as ``ProfilerStep#N`` or c10d's ``nccl:all_to_all``, projected onto the GPU
    timeline: it spans kernels, it is not one). A CPU-only profile gives an empty list.
    """
    return [KernelSpan(ev.name, float(ev.time_range.start), float(ev.time_range.end))
            for ev in events if ev.device_type == torch.autograd.DeviceType.CUDA
            and not getattr(ev, "is_user_annotation", False)]


def profile_kernel_spans(prof: torch.profiler.profile) -> list[KernelSpan]:
    """:func:`kernel_spans` of a finished profiler, read from its raw Kineto results.

    ``prof.events()`` builds a Python object (and an op tree) for every event, host ops
    included: about 11 s for 300k events on a loaded 2-core CPU, against 0.3 s for the
    raw results; a rank pauses every other rank while it summarises. The raw results
    are not public API, so where this torch lacks them it falls back to
    ``prof.events()``.
    """
    results = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if results is not None:
        try:
            cuda = torch.autograd.DeviceType.CUDA
            return [KernelSpan(e.name(), e.start_ns() / 1e3,
                               (e.start_ns() + e.duration_ns()) / 1e3)
                    for e in results.events()
                    if e.device_type() == cuda and not e.is_user_annotation()]
        except AttributeError:  # another torch's event API: the public path below
            pass
    return kernel_spans(prof.events())


def busy_us(spans: Iterable[KernelSpan]) -> float:
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


def summarize_kernels(spans: list[KernelSpan], steps: int, wall_s: float) -> dict[str, Any]:
    """Per-step figures of a window of ``steps`` steps whose kernels are ``spans``.

    Args:
        spans: every device activity recorded in the window.
        steps: how many steps the window holds (>= 1).
        wall_s: their wall time, summed (seconds).

    Returns:
        A JSON-able dict (all times in milliseconds per step, rounded to 3 decimals):
        ``steps``, ``step_wall_ms``, ``gpu_busy_ms_per_step``, ``host_gap_ms_per_step``,
        ``kernels_per_step`` (float: a count over steps), ``gpu_ms_per_step_by_kind``
        (the kinds of :data:`KERNEL_KINDS` plus ``other``), ``nccl_ms_per_step`` (the
        NCCL kernels of the ``exchange`` kind), ``top_kernels_ms_per_step`` (up to 15
        ``[name, ms per step, count per step]``, slowest first).

    Raises:
        ValueError: ``steps`` < 1 or a negative ``wall_s``.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if wall_s < 0:
        raise ValueError(f"wall_s must be >= 0 seconds, got {wall_s}")
    by_kind = dict.fromkeys([*KERNEL_KINDS, OTHER], 0.0)
    by_name: dict[str, list[float]] = {}
    nccl_us = 0.0
    for s in spans:
        dur = s.end_us - s.start_us
        by_kind[kernel_kind(s.name)] += dur
        if "nccl" in s.name.lower():
            nccl_us += dur
        acc = by_name.setdefault(s.name, [0.0, 0])
        acc[0] += dur
        acc[1] += 1
    wall_ms = wall_s * 1e3 / steps
    busy_ms = busy_us(spans) / 1e3 / steps
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]

    def per_step_ms(us: float) -> float:
        return round(us / 1e3 / steps, 3)

    return {
        "steps": steps,
        "step_wall_ms": round(wall_ms, 3),
        "gpu_busy_ms_per_step": round(busy_ms, 3),
        "host_gap_ms_per_step": round(wall_ms - busy_ms, 3),
        "kernels_per_step": round(len(spans) / steps, 1),
        "gpu_ms_per_step_by_kind": {k: per_step_ms(v) for k, v in by_kind.items()},
        "nccl_ms_per_step": per_step_ms(nccl_us),
        "top_kernels_ms_per_step": [[name[:NAME_CHARS], per_step_ms(us), round(n / steps, 1)]
                                    for name, (us, n) in top],
    }


def summarize_profile(prof: torch.profiler.profile, steps: int, wall_s: float
                      ) -> dict[str, Any]:
    """:func:`summarize_kernels` of a finished (stopped) profiler's device activities.

    Args:
        prof: a ``torch.profiler.profile`` after ``stop()`` (or inside its
            ``on_trace_ready``), that recorded exactly the ``steps`` steps.
        steps: steps in the window (>= 1).
        wall_s: their wall time, summed (seconds).

    Raises:
        ValueError: as :func:`summarize_kernels`.
    """
    return summarize_kernels(profile_kernel_spans(prof), steps, wall_s)
