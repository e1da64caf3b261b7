"""Per-rank ``torch.profiler`` over a window of serving steps (named like vLLM's
``VLLM_TORCH_PROFILER_DIR``).

Environment (read once when a rank starts; unset = no profiler object at all)::

    ELASTICEP_TORCH_PROFILER_DIR=DIR        profile, and write DIR/rank{r}.json and
                                            DIR/rank{r}.trace.json
    ELASTICEP_TORCH_PROFILER_STEPS=SKIP:COUNT   the window: skip SKIP steps, profile the
                                            next COUNT (default 20:10)
    ELASTICEP_TORCH_PROFILER_CPU=1|0        also record host-side ops (default 1)

A step is one working lockstep step, as fault injection counts them: iterations with no
work anywhere are not counted, and every rank counts the same steps, so all ranks
profile the same window. Step ``SKIP - 1`` runs under the profiler as its warm-up
(discarded: the first profiled step pays CUPTI's start-up). A step's wall time runs from
the start of its loop iteration (the header collective included) to its commit; idle
iterations inside the window are in the trace but not in the wall time. The summary
(:func:`elasticep.utils.profile_summary.summarize_profile`) also carries the mean wall
time of up to COUNT steps just before the warm-up, unprofiled, so the profiler's own
cost is visible.

Host-side ops are recorded by default: the step-time question is usually where the
host spends the gaps between kernels (collectives on Gloo, syncs, launches), which a
CUDA-only trace cannot show. It costs about 1 us per op on the host (measured on CPU
with torch 2.13), visible as ``step_wall_ms`` against ``unprofiled_step_wall_ms``;
``ELASTICEP_TORCH_PROFILER_CPU=0`` leaves only the device activities and the CUDA
runtime calls.

The profiler never stops serving: any error it raises is logged once and profiling is
dropped for the rest of the process. ``rank{r}.json`` is written after the trace (and
atomically), so a reader that sees it can read both files. A relaunched or joining rank
counts steps from its own start and writes its file again.

Keep COUNT modest: after the window the rank stops the profiler, writes the trace and
summarises it, and every other rank waits for it at the next collective. Stopping and
writing hold the GIL (0.9 s and 0.3 s for 300k events on a loaded 2-core CPU, measured),
which also holds the rank's heartbeat thread; a pause longer than the heartbeat timeout
(2 s by default) would get the rank evicted as frozen.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from elasticep.elastic.profiler_settings import (  # re-exported: the module's settings
    CPU_ENV,
    DIR_ENV,
    STEPS_ENV,
    ProfilerSettings,
    profiler_settings,
)
from elasticep.utils.profile_summary import summarize_profile

logger = logging.getLogger(__name__)

__all__ = ["CPU_ENV", "DIR_ENV", "STEPS_ENV", "ProfilerSettings", "StepProfiler",
           "profiler_settings"]


class StepProfiler:
    """Profiles one window of a rank's working steps and writes its two files.

    The step loop calls :meth:`iteration_started` at the top of every loop iteration and
    :meth:`step_committed` after every committed working step, and drops the object
    once :meth:`step_committed` returns True.

    Args:
        settings: from :func:`profiler_settings`.
        rank: this rank (names the files).
        device: the rank's device; ``cuda...`` adds CUDA activity.
        clock: monotonic seconds (tests pass a fake).
        profile_factory: builds the ``torch.profiler.profile`` (tests may wrap it).
    """

    def __init__(self, settings: ProfilerSettings, rank: int, device: str = "cpu",
                 clock: Callable[[], float] = time.perf_counter,
                 profile_factory: Callable[..., Any] = torch.profiler.profile) -> None:
        self.settings, self.rank, self.clock = settings, rank, clock
        self.cuda = device.startswith("cuda")
        self.activities = ([torch.profiler.ProfilerActivity.CPU]
                           if settings.with_cpu or not self.cuda else [])
        if self.cuda:
            self.activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._factory = profile_factory
        self._prof: Any = None
        self._committed = 0
        self._t_iter: float | None = None
        self._before: deque[float] = deque(maxlen=settings.count)
        self._walls: list[float] = []
        self._tokens: list[int] = []
        self._max_tokens: list[int] = []
        self._epochs: list[int] = []
        self.finished = False  # written, or failed: nothing more to do
        self.written: Path | None = None
        settings.out_dir.mkdir(parents=True, exist_ok=True)

    @classmethod
    def from_env(cls, rank: int, device: str = "cpu",
                 environ: Mapping[str, str] | None = None) -> StepProfiler | None:
        """A profiler when ``$ELASTICEP_TORCH_PROFILER_DIR`` is set, else None. A bad
        value (the commands refuse it up front) or an unwritable directory is logged in
        one line and gives None: serving goes on unprofiled."""
        try:
            settings = profiler_settings(environ)
            if settings is None:
                return None
            prof = cls(settings, rank, device)
        except (ValueError, OSError) as exc:
            logger.error("rank %d: torch profiler off: %s", rank, exc)
            return None
        logger.info("rank %d: torch profiler on: steps %d..%d (%s) into %s", rank,
                    settings.skip, settings.skip + settings.count - 1,
                    "+".join(a.name.lower() for a in prof.activities), settings.out_dir)
        return prof

    @property
    def _window(self) -> range:
        s = self.settings
        return range(s.skip, s.skip + s.count)

    def iteration_started(self) -> None:
        """A loop iteration begins (working or not): starts the profiler before the
        warm-up step, and the clock of the step this iteration may commit."""
        if self.finished:
            return
        try:
            if self._prof is None and self._committed >= max(self.settings.skip - 1, 0):
                self._start()
        except Exception as exc:  # noqa: BLE001 - a profiler failure must not stop serving
            self._fail(exc)
        self._t_iter = self.clock()

    def _start(self) -> None:
        warmup = 1 if self.settings.skip > 0 else 0
        self._prof = self._factory(
            activities=self.activities,
            schedule=torch.profiler.schedule(wait=0, warmup=warmup, active=self.settings.count,
                                             repeat=1),
            on_trace_ready=self._write)
        self._prof.start()

    def step_committed(self, tokens: int, max_tokens: int, epoch: int) -> bool:
        """A working step committed.

        Args:
            tokens: tokens of this rank's batch in that step (0 on an idle rank).
            max_tokens: the step's agreed largest batch over the ranks.
            epoch: the membership epoch it committed at.

        Returns:
            True once the window is written or profiling failed: drop this object.
        """
        if self.finished:
            return True
        wall = self.clock() - self._t_iter if self._t_iter is not None else 0.0
        step = self._committed
        self._committed += 1
        try:
            if step in self._window:
                self._walls.append(wall)
                self._tokens.append(tokens)
                self._max_tokens.append(max_tokens)
                self._epochs.append(epoch)
            elif self._prof is None:
                self._before.append(wall)
            if self._prof is not None:
                if step == self._window[-1] and self.cuda:
                    torch.cuda.synchronize()  # the window's last kernels into the trace
                self._prof.step()  # after the window's last step: stops and writes
                if self.finished:
                    prof, self._prof = self._prof, None
                    prof.stop()
        except Exception as exc:  # noqa: BLE001 - a profiler failure must not stop serving
            self._fail(exc)
        return self.finished

    def _write(self, prof: Any) -> None:
        """``on_trace_ready``: the chrome trace, then the summary (atomic)."""
        out = self.settings.out_dir
        t0 = self.clock()
        prof.export_chrome_trace(str(out / f"rank{self.rank}.trace.json"))
        export_s = self.clock() - t0
        summary = summarize_profile(prof, len(self._walls), sum(self._walls))
        row = {"rank": self.rank, "epoch": self._epochs[-1],
               "epochs": sorted(set(self._epochs)), "skip": self.settings.skip,
               "activities": [a.name.lower() for a in self.activities],
               "batch_tokens": self._tokens, "max_batch_tokens": self._max_tokens,
               "step_wall_ms_each": [round(w * 1e3, 3) for w in self._walls],
               "unprofiled_step_wall_ms": (round(statistics.mean(self._before) * 1e3, 3)
                                           if self._before else None),
               "unprofiled_steps": len(self._before),
               "trace": f"rank{self.rank}.trace.json", "trace_export_s": round(export_s, 3),
               **summary}
        tmp = out / f".rank{self.rank}.json.tmp"
        tmp.write_text(json.dumps(row, indent=1) + "\n")
        tmp.replace(out / f"rank{self.rank}.json")
        self.written = out / f"rank{self.rank}.json"
        self.finished = True
        logger.info("rank %d: torch profile of steps %d..%d written to %s: %.3f ms/step, "
                    "GPU busy %.3f ms/step (trace export %.2f s, a pause for every rank)",
                    self.rank, self._window[0], self._window[-1], self.written,
                    summary["step_wall_ms"], summary["gpu_busy_ms_per_step"], export_s)

    def _fail(self, exc: BaseException) -> None:
        logger.error("rank %d: torch profiler failed, profiling dropped: %s: %s", self.rank,
                     type(exc).__name__, exc)
        self.finished = True
        prof, self._prof = self._prof, None
        if prof is not None:
            try:
                prof.stop()
            except Exception:  # noqa: BLE001 - already reported the first error
                pass
