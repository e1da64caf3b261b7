"""CI's draw of the 2-node chaos kinds: two seeded trials against a real 2-node
deployment with its membership in a 3-member etcd on 127.0.0.1 (seed 0 draws
`node-0-host-kill`, then `leader-kill`; :mod:`elasticep_testkit.chaos.two_nodes`).
Every invariant of the runner holds: no failed or wrong request, no split brain, the
ranks back in place after a leader kill, node 0 readmitted after its host died. The
schedules and the log readers are tested without a deployment in
``tests/test_chaos_hosts.py``.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from elasticep_testkit.chaos.schedule import HOST_KINDS, Schedule

ROOT = Path(__file__).resolve().parents[1]
SEED, TRIALS = 0, 2
ARGS = ["--nnodes", "2", "--trials", str(TRIALS), "--seed", str(SEED), "--max-tokens", "24",
        "--concurrency", "4"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_two_node_chaos_trials_keep_every_invariant():
    proc = subprocess.Popen([sys.executable, "-m", "elasticep_testkit.chaos", *ARGS], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # the runner stops its deployment on the way out
        out, err = proc.communicate(timeout=45)
        pytest.fail(f"2-node chaos run took over 240 s:\n{out}\n{err[-3000:]}")
    assert proc.returncode == 0, out + err[-3000:]
    assert f"{TRIALS} trials, 0 with violations, 0 violations" in out, out
    trials = [ln for ln in out.splitlines() if ln.startswith("trial ")]
    assert len(trials) == TRIALS and all("0 clear errors" in t for t in trials), out
    ran = {f.kind for t in trials
           for f in Schedule.parse(t.split(": ", 1)[1].split(" | ")[0]).faults}
    assert ran == set(HOST_KINDS), out
