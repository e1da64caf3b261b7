"""`elasticep generate --ep-size 2` as a user runs it: same output format and tokens as
--ep-size 1, with the plain Gloo baseline (--elastic-ep-backend none) and the elastic
backend, and with ranks that run one request at a time; a successful run's shutdown
logs no failure."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

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
    cmd = [sys.executable, "-m", "elasticep.entrypoints.cli", "generate", "--model", str(DEMO_MODEL),
           "--prompts-file", str(f), "--max-tokens", "8", "--ep-size", "2",
           "--ep-num-redundant-experts", "2", "--elastic-ep-backend", backend, *limits]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    # a normal shutdown is no failure: no rank death, failure epoch or lost coordinator
    for word in (" dead", "kind=failure", "CoordinatorLostError", "ERROR"):
        assert word not in run.stderr, run.stderr[-3000:]
    rows = [json.loads(line) for line in run.stdout.splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2]
    eos = 0  # the demo model's eos_token_id
    for r, want in zip(rows, ref, strict=False):
        got = r["token_ids"]
        assert got == want[: len(got)] and (len(got) == 8 or got[-1] == eos)
        assert r["text"] == tokenizer().decode([t for t in got if t != eos])
