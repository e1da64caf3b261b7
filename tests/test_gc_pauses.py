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


def test_generate_of_one_rank_warns_in_its_own_process(caplog, capsys):
    """generate --ep-size 1 runs the model in its own process: the flag used to be
    accepted and ignored there; and a short collection was logged as "took 0.000 s
    (over 1e-06 s)"."""
    import re

    from elasticep.entrypoints.cli import build_parser
    from elasticep.entrypoints.generate_cmd import run
    from elasticep.utils.gc_pauses import warn_long_collections

    args = build_parser().parse_args(["generate", "--prompt", "hi", "--max-tokens", "2",
                                      "--gc-warning-threshold-secs", "1e-6"])
    try:
        assert run(args) == 0
    finally:
        warn_long_collections(0.0)  # the hook is process-wide
    took = [float(m[1]) for r in caplog.records
            if (m := re.match(r"garbage collection of generation \d took (\S+) s",
                              r.getMessage()))]
    assert took and min(took) > 1e-6, caplog.text[-2000:]
