"""A worker whose launcher died while it started must not run on its own."""

from __future__ import annotations

import os
import subprocess
import sys

from elasticep.utils.procs import PARENT_PID_ENV


def test_worker_exits_before_heavy_imports_when_its_launcher_is_gone():
    # The launcher named in the environment is not our parent: as if it died and the
    # worker was re-parented before it could ask to die with it.
    env = dict(os.environ, **{PARENT_PID_ENV: "1"})
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "elasticep.elastic.worker",
                        "--config-json", "{}"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 1
    imported = {line.rsplit("|", 1)[-1].strip() for line in p.stderr.splitlines()
                if line.startswith("import time:")}
    assert "elasticep.utils.procs" in imported
    assert "torch" not in imported  # it left before the seconds-long imports


def test_a_worker_that_outlives_its_launcher_leaves_the_marker_its_launcher_waits_for(tmp_path):
    """`join` hands its admitted ranks over: a worker clears its parent-death signal
    (outlive_parent) and says so with a marker file, for which the launcher waits before
    it exits (exiting first would let the kernel's signal kill the new member)."""
    marker = tmp_path / "outlived"
    code = ("from elasticep.utils.procs import die_with_parent, outlive_parent\n"
            "die_with_parent()\n"
            "print(outlive_parent())\n")
    env = {**os.environ, "ELASTICEP_OUTLIVE_LAUNCHER": "1",
           "ELASTICEP_OUTLIVE_MARKER": str(marker)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.stdout.strip() == "True" and marker.exists(), out.stderr
    marker.unlink()
    env["ELASTICEP_OUTLIVE_LAUNCHER"] = "0"  # a launcher that keeps its workers: no marker
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.stdout.strip() == "False" and not marker.exists(), out.stderr
