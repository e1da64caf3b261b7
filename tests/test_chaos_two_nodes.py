"""CI's draw of the 2-node chaos kinds: two seeded trials against a real 2-node
deployment with its membership in a 3-member etcd on 127.0.0.1 (seed 0 draws
`node-0-host-kill`, then `leader-kill`; :mod:`elasticep_testkit.chaos.two_nodes`).
Every invariant of the runner holds: no failed or wrong request, no split brain, the
ranks back in place after a leader kill, node 0 readmitted after its host died. The
schedules and the log readers are tested without a deployment in
``tests/test_chaos_hosts.py``.
"""

from __future__ import annotations

import pytest
from _chaos_run import run_chaos_trials

from elasticep_testkit.chaos.schedule import HOST_KINDS

SEED, TRIALS = 0, 2
ARGS = ["--nnodes", "2", "--trials", str(TRIALS), "--seed", str(SEED), "--max-tokens", "24",
        "--concurrency", "4"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_two_node_chaos_trials_keep_every_invariant():
    assert run_chaos_trials(ARGS, TRIALS, 240) == set(HOST_KINDS)
