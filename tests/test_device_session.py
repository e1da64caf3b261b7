"""bench/device_session.sh: every record names the commit of the tree that ran it, an
A/B base tree (``.ab/NAME``) included."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def tree_commit(cwd: Path, name: str, env_commit: str | None) -> subprocess.CompletedProcess:
    """The script's ``tree_commit NAME``, defined from the script's own text, in ``cwd``."""
    body = (REPO / "bench" / "device_session.sh").read_text()
    start = body.index("tree_commit() {")
    func = body[start:body.index("\n}\n", start) + 3]
    env = {"PATH": "/usr/bin:/bin"}
    if env_commit is not None:
        env["ELASTICEP_COMMIT"] = env_commit
    return subprocess.run(["bash", "-c", f"{func}\ntree_commit {name}"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=10)


def test_each_tree_is_stamped_with_its_own_commit(tmp_path):
    (tmp_path / ".ab" / "base").mkdir(parents=True)
    (tmp_path / ".ab" / "base" / "COMMIT").write_text("4a469b3\n")
    (tmp_path / ".ab" / "nocommit").mkdir()
    assert tree_commit(tmp_path, "new", "008d7d2").stdout.strip() == "008d7d2"
    assert tree_commit(tmp_path, "base", "008d7d2").stdout.strip() == "4a469b3"
    missing = tree_commit(tmp_path, "nocommit", "008d7d2")
    assert missing.returncode != 0 and missing.stdout == ""
    assert "no .ab/nocommit/COMMIT" in missing.stderr
    assert tree_commit(tmp_path, "new", None).returncode != 0
