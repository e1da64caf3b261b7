"""`elasticep generate --ep-size 2` as a user runs it: same output format and tokens as
--ep-size 1, with the plain Gloo baseline (--elastic-ep-backend none) and the elastic
backend, and with ranks that run one request at a time; a successful run's shutdown
logs no failure. A rank that dies while loading ends generate with one error line."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _ckpt_copy import checkpoint_without

from elasticep_testkit.ep import reference, tokenizer
from elasticep_testkit.paths import DEMO_MODEL, REPO

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("backend, limits", [
    ("none", []), ("elastic", []),
    # one request at a time per rank: the third prompt waits in the front-end for room
    ("elastic", ["--max-running-requests", "1"]),
])
def test_generate_ep2_matches_reference(tmp_path, backend, limits):
    ref, _ = reference()
    from elasticep_testkit.ep import prompts

    texts = [tokenizer().decode(list(p)) for p in prompts()[:3]]
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": t}) for t in texts))
    logs = tmp_path / "logs"
    cmd = [sys.executable, "-m", "elasticep.entrypoints.cli", "generate", "--model", str(DEMO_MODEL),
           "--prompts-file", str(f), "--max-tokens", "8", "--ep-size", "2",
           "--ep-num-redundant-experts", "2", "--elastic-ep-backend", backend, *limits,
           "--log-dir", str(logs)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    # a normal shutdown is no failure: no rank death, failure epoch or lost coordinator,
    # in generate's own stderr (the coordinator's too) nor in either rank's log
    rank_logs = sorted(logs.glob("rank*.log"))
    assert [p.name for p in rank_logs] == ["rank0.log", "rank1.log"]
    for name, text in [("stderr", run.stderr), *((p.name, p.read_text()) for p in rank_logs)]:
        for word in (" dead", "kind=failure", "CoordinatorLostError", "ERROR"):
            assert word not in text, (name, text[-3000:])
    rows = [json.loads(line) for line in run.stdout.splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2]
    eos = 0  # the demo model's eos_token_id
    for r, want in zip(rows, ref, strict=False):
        got = r["token_ids"]
        assert got == want[: len(got)] and (len(got) == 8 or got[-1] == eos)
        assert r["text"] == tokenizer().decode([t for t in got if t != eos])


def test_a_rank_dying_while_loading_is_one_error_line(tmp_path):
    """A checkpoint whose index lacks one attention weight: every rank's loader raises;
    generate exits 2 with one line naming the rank, its exception and the log that
    holds the traceback; no rank traceback reaches its stderr."""
    key = "model.layers.0.self_attn.o_proj.weight"
    ckpt = checkpoint_without(DEMO_MODEL, tmp_path / "ckpt", key)
    cmd = [sys.executable, "-m", "elasticep.entrypoints.cli", "generate", "--model", str(ckpt),
           "--prompt", "hi", "--max-tokens", "2", "--ep-size", "2"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert run.returncode == 2, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, run.stderr[-3000:]
    found = re.fullmatch(r"elasticep generate: error: rank (\d) exited with 1 while loading: "
                         r"(\w+Error: .*) \(traceback in (rank\d\.log) in (\S+)\)", errors[0])
    assert found, errors[0]
    rank, exc, log_name, log_dir = found.groups()
    assert log_name == f"rank{rank}.log" and key in exc, errors[0]
    # the one info line names the temporary directory the rank logs went to
    assert f"worker logs in {log_dir}" in run.stderr, run.stderr[-3000:]
    log = (Path(log_dir) / log_name).read_text()
    shutil.rmtree(log_dir)  # made for this run
    assert "Traceback (most recent call last)" in log and log.rstrip().endswith(exc), log[-3000:]


def test_loading_failure_is_one_line_naming_the_traceback_file():
    from elasticep.deploy.startup_error import loading_failure

    tail = ("Traceback (most recent call last):\n  File \"/x/loader.py\", line 7, in get\n"
            "    raise KeyError(key)\nKeyError: 'w'\n")
    assert loading_failure(1, 1, tail, Path("/tmp/l")) == (
        "rank 1 exited with 1 while loading: KeyError: 'w' (traceback in rank1.log in /tmp/l)")
    assert loading_failure(0, -9, "") == "rank 0 exited with -9 while loading; its log is empty"
