"""A server's start-up heap frozen out of the garbage collector's scans
(:mod:`elasticep.utils.startup_heap`), in a child process (freezing is process-wide)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from elasticep_testkit.paths import REPO

pytestmark = pytest.mark.timeout(60)

_CHILD = """
import gc, json, sys
from elasticep.utils.startup_heap import freeze_startup_heap
startup = [[i] for i in range(200_000)]  # the imports and models of a real start-up
frozen = freeze_startup_heap()
gen2_after = len(gc.get_objects(generation=2))  # what an oldest collection walks
a, b = [], []
a.append(b); b.append(a)  # garbage made later: still collected
del a, b
later = gc.collect()
print(json.dumps({"frozen": frozen, "gen2": gen2_after, "later": later}))
"""


def test_the_start_up_objects_are_frozen_and_later_garbage_is_still_collected():
    run = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                         timeout=50, cwd=REPO)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["frozen"] >= 200_000, out  # every start-up list
    assert out["gen2"] < 1_000, out  # an oldest collection no longer walks them
    assert out["later"] >= 2, out  # the cycle made after the freeze
