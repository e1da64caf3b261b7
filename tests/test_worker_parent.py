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
