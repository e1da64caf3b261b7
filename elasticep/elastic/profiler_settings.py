"""The profiler's environment variables, read without torch (``serve`` and ``join``
check them up front, before any rank starts; :mod:`elasticep.elastic.step_profiler`
has what they mean)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

DIR_ENV = "ELASTICEP_TORCH_PROFILER_DIR"
STEPS_ENV = "ELASTICEP_TORCH_PROFILER_STEPS"
CPU_ENV = "ELASTICEP_TORCH_PROFILER_CPU"
DEFAULT_SKIP, DEFAULT_COUNT = 20, 10


@dataclass(frozen=True)
class ProfilerSettings:
    """Where and what to profile.

    Attributes:
        out_dir: the directory of the rank files (created when the rank starts).
        skip: working steps before the window (>= 0); the last of them is the warm-up.
        count: working steps in the window (>= 1).
        with_cpu: record host-side ops too (CUDA activity is always on for a CUDA rank).
    """

    out_dir: Path
    skip: int = DEFAULT_SKIP
    count: int = DEFAULT_COUNT
    with_cpu: bool = True


def profiler_settings(environ: Mapping[str, str] | None = None) -> ProfilerSettings | None:
    """Read the profiler variables (see the module docstring).

    Args:
        environ: the environment (default ``os.environ``).

    Returns:
        The settings, or None when ``ELASTICEP_TORCH_PROFILER_DIR`` is unset or empty.

    Raises:
        ValueError: a one-line message naming the variable: STEPS not ``SKIP:COUNT``
            with SKIP >= 0 and COUNT >= 1, CPU not 0 or 1, DIR an existing non-directory,
            or STEPS / CPU set without DIR.
    """
    env = os.environ if environ is None else environ
    out_dir = env.get(DIR_ENV, "")
    steps, cpu = env.get(STEPS_ENV), env.get(CPU_ENV)
    if not out_dir:
        stray = [name for name, v in ((STEPS_ENV, steps), (CPU_ENV, cpu)) if v]
        if stray:
            raise ValueError(f"{stray[0]} is set but {DIR_ENV} is not: set {DIR_ENV}=DIR to "
                             "profile, or unset both")
        return None
    path = Path(out_dir).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"{DIR_ENV}={out_dir!r} exists and is not a directory")
    skip, count = DEFAULT_SKIP, DEFAULT_COUNT
    if steps:
        a, sep, b = steps.partition(":")
        if not (sep and a.strip().isdigit() and b.strip().isdigit() and int(b) >= 1):
            raise ValueError(f"{STEPS_ENV} must be SKIP:COUNT with integers SKIP >= 0 and "
                             f"COUNT >= 1 (e.g. {DEFAULT_SKIP}:{DEFAULT_COUNT}), got {steps!r}")
        skip, count = int(a), int(b)
    if cpu not in (None, "", "0", "1"):
        raise ValueError(f"{CPU_ENV} must be 0 or 1, got {cpu!r}")
    return ProfilerSettings(path, skip, count, cpu != "0")
