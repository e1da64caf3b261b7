"""The commit a benchmark record names: the tree that ran it.

Every bench's JSON line carries ``"commit"`` from :func:`commit`, so each published
figure can name the tree it measured (``python -m bench.check_claims`` checks that).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def commit() -> str:
    """``$ELASTICEP_COMMIT`` if set, else the repository's short commit, ``-dirty`` when
    tracked files changed ("unknown" without git).

    The variable wins because a tree copied to another machine may carry a stale .git,
    and because an A/B run of an older tree's package beside this tree's benches must
    name the older tree (``bench/device_session.sh``'s ``tree_commit``).
    """
    if os.environ.get("ELASTICEP_COMMIT"):
        return os.environ["ELASTICEP_COMMIT"]

    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    try:
        head = git("rev-parse", "--short", "HEAD") or "unknown"
        return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no")
                       else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
