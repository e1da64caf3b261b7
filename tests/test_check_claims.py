"""``python -m bench.check_claims``: every figure of the README and the docs has a raw
record that holds it, and the check fails on each way a figure can go wrong."""

from __future__ import annotations

import json
from pathlib import Path

from bench import check_claims
from bench.check_claims import REGISTRY, Claim, check, table

REPO = Path(__file__).resolve().parents[1]


def test_every_published_figure_has_its_record():
    problems, n = check(REPO)
    assert problems == []
    assert n >= 20


RUNS = [  # served/engine at 64 clients, as in the records the audit found left out
    {"commit": "aaa1111", "label": "new1", "max_concurrency": 64, "ratio": 1.110},
    {"commit": "bbb2222", "label": "new1", "max_concurrency": 64, "ratio": 1.161},
    {"commit": "ccc3333", "label": "base1", "max_concurrency": 64, "ratio": 1.300},
    {"commit": "ccc3333", "label": "new2", "max_concurrency": 1, "ratio": 1.2},
    {"commit": "ccc3333", "label": "new3", "max_concurrency": 64, "ratio": 1.146},
]
CLAIM = """
[[claim]]
doc = "README.md"
text = "{text}"
kind = "range"
records = ["docs/results/{record}"]
where = {{ max_concurrency = 64, label = "re:^new" }}
value = "ratio"
commits = {commits}
command = "python -m bench.serving_sweep"
"""


def make_tree(root: Path, readme: str, text: str, *, record: str = "sweep.jsonl",
              commits: str = '["aaa1111", "bbb2222", "ccc3333"]') -> None:
    """A tree with README.md, one record, the registry and its index."""
    (root / "docs" / "results").mkdir(parents=True)
    (root / "README.md").write_text(readme)
    (root / "docs" / "results" / "sweep.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in RUNS))
    registry = CLAIM.format(text=text, record=record, commits=commits)
    (root / REGISTRY).write_text(registry)
    import tomllib
    claims = [Claim(**c) for c in tomllib.loads(registry)["claim"]]
    (root / "docs" / "results" / "README.md").write_text(table(claims) + "\n")


def test_a_range_over_every_run_holds(tmp_path):
    make_tree(tmp_path, "64 clients: 1.110-1.161x the engine.\n", "1.110-1.161x")
    assert check(tmp_path) == ([], 1)
    assert check_claims.main(["--root", str(tmp_path)]) == 0


def test_a_range_that_leaves_out_a_run_fails(tmp_path):
    make_tree(tmp_path, "64 clients: 1.110-1.146x the engine.\n", "1.110-1.146x")
    problems, _ = check(tmp_path)
    assert problems == ["README.md: '1.110-1.146x': the records span 1.11-1.161 (3 rows)"]
    assert check_claims.main(["--root", str(tmp_path)]) == 1


def test_a_figure_without_a_claim_fails_with_its_line(tmp_path):
    make_tree(tmp_path, "64 clients: 1.110-1.161x.\nbatch 1: 4.67 ms, 2.5x faster\n",
              "1.110-1.161x")
    problems, _ = check(tmp_path)
    assert [p.split(" names")[0] for p in problems] == [
        "README.md:2: figure '4.67 ms'", "README.md:2: figure '2.5x'"]


def test_a_missing_record_another_commit_or_a_missing_text_fails(tmp_path):
    make_tree(tmp_path / "a", "1.110-1.161x\n", "1.110-1.161x", record="gone.jsonl")
    assert check(tmp_path / "a")[0] == [
        "README.md: '1.110-1.161x': record docs/results/gone.jsonl does not exist"]
    make_tree(tmp_path / "b", "1.110-1.161x\n", "1.110-1.161x", commits='["aaa1111"]')
    assert check(tmp_path / "b")[0] == [
        "README.md: '1.110-1.161x': a row's commit bbb2222 is not in ['aaa1111']"]
    make_tree(tmp_path / "c", "nothing here\n", "1.110-1.161x")
    assert check(tmp_path / "c")[0] == ["README.md: '1.110-1.161x': not in the doc"]


def test_a_stale_index_table_fails(tmp_path):
    make_tree(tmp_path, "1.110-1.161x\n", "1.110-1.161x")
    (tmp_path / "docs" / "results" / "README.md").write_text("no table\n")
    assert check(tmp_path)[0] == [
        "docs/results/README.md: its claims table is not the registry's (write it with "
        "`python -m bench.check_claims --table`)"]
