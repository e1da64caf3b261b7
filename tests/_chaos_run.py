"""Run the chaos runner as CI does and check its verdict (not a test module)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from elasticep_testkit.chaos.schedule import Schedule

ROOT = Path(__file__).resolve().parents[1]


def run_chaos_trials(args: list[str], trials: int, timeout_s: float) -> set[str]:
    """``python -m elasticep_testkit.chaos ARGS`` from the repository root; fails the test
    unless it exits 0 after ``trials`` trials with no violation and no clear client error.
    On a timeout it is interrupted (the runner stops its deployment on SIGINT).

    Returns:
        The fault kinds the trials ran.
    """
    proc = subprocess.Popen([sys.executable, "-m", "elasticep_testkit.chaos", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=45)
        pytest.fail(f"chaos run took over {timeout_s:.0f} s:\n{out}\n{err[-3000:]}")
    assert proc.returncode == 0, out + err[-3000:]
    assert f"{trials} trials, 0 with violations, 0 violations" in out, out
    lines = [ln for ln in out.splitlines() if ln.startswith("trial ")]
    assert len(lines) == trials and all("0 clear errors" in t for t in lines), out
    # "trial N: KIND:ranks=..;KIND:ranks=.. | ...": the kinds that ran
    return {f.kind for t in lines
            for f in Schedule.parse(t.split(": ", 1)[1].split(" | ")[0]).faults}
