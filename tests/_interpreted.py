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
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, test_file], env=env, capture_output=True,
                          text=True, timeout=timeout_s, cwd=Path(test_file).parents[1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
