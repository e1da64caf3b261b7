"""The warning for long garbage collections (:mod:`elasticep.utils.gc_pauses`,
``--gc-warning-threshold-secs``), in a child process (the hook is process-wide); the
flag's refusals are among tests/test_deployment_config.py's and tests/test_serve_cli.py's."""

from __future__ import annotations

import subprocess
import sys

import pytest

from elasticep_testkit.paths import REPO

pytestmark = pytest.mark.timeout(60)

_CHILD = """
import gc, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
from elasticep.utils.gc_pauses import warn_long_collections
heap = [[i] for i in range(300_000)]  # a full collection walks every one of them
assert warn_long_collections(float(sys.argv[1])) == (float(sys.argv[1]) > 0)
gc.collect()
warn_long_collections(0.0)  # removed: nothing more is logged
gc.collect()
"""


def _collections_logged(threshold_s: float) -> list[str]:
    run = subprocess.run([sys.executable, "-c", _CHILD, str(threshold_s)],
                         capture_output=True, text=True, timeout=50, cwd=REPO)
    assert run.returncode == 0, run.stderr[-2000:]
    return [line for line in run.stderr.splitlines() if "garbage collection" in line]


def test_a_collection_longer_than_the_threshold_is_logged_once_and_none_when_off():
    lines = _collections_logged(1e-6)  # a full collection of 300,000 lists takes longer
    full = [line for line in lines if "of generation 2 took " in line]
    assert len(full) == 1 and full[0].startswith("WARNING garbage collection"), lines
    assert _collections_logged(0.0) == []  # off
    assert _collections_logged(60.0) == []  # none that long
