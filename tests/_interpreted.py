"""Run a test module's ``__main__`` under ``TRITON_INTERPRET=1`` (Triton kernels on CPU
tensors; the flag must be set before triton is imported, hence a child process) and
return the JSON its last output line prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def run_interpreted(test_file: str, timeout_s: float) -> Any:
    """The last stdout line of ``python test_file`` with ``TRITON_INTERPRET=1``, parsed.

    Raises:
        AssertionError: the child exited non-zero (its stderr's tail is the message).
        subprocess.TimeoutExpired: it ran past ``timeout_s`` seconds.
    """
    root = Path(test_file).resolve().parents[1]
    # the repository first on the child's path, as pytest's own (pyproject's pythonpath):
    # a script's path holds only its folder, and the editable install maps elasticep only
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, test_file], env=env, capture_output=True,
                          text=True, timeout=timeout_s, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
