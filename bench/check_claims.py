"""Every measured figure in the README and the docs names its raw record, and agrees with it.

    python -m bench.check_claims          # exit 0, or 1 with one line per problem

The registry is ``docs/results/claims.toml``. Each ``[[claim]]`` is one figure as
printed (``text``, verbatim in ``doc``) and where it comes from: the raw ``records``
(JSON-lines files, or a ``.json`` file with a ``pointer`` to a list of rows), the rows
that count (``where``), the field (``value``), the ``commits`` of the trees that ran
them, and the ``command`` that produced them. The check:

1. the text is in the doc, every record file exists, and ``where`` selects rows;
2. the printed numbers agree with the selected rows' values at the printed precision:
   ``kind = "value"`` (one value), ``"values"`` (every run listed), ``"range"`` (``a-b``
   is the minimum and maximum of every selected row: a range covers every recorded run,
   not a chosen subset); ``count``, if given, is the number of selected rows;
3. every selected row names its commit (its own ``commit`` field, or that of the last
   ``section: meta`` row before it) and that commit is one of ``commits``; for records
   written before the benches stamped one, ``record_commit`` names it, and then every
   record file's name must contain it (the device sessions name each file by the
   commit that ran it);
4. ``docs/results/README.md`` holds the registry as a table (``--table`` writes it);
5. every figure with a unit of measure (``ms``, ``us``, ``x``, ``%``, ``tok/s``, or
   seconds with a decimal point) in the scanned docs, outside fenced code blocks, lies
   inside a claim's text or a ``[[not_measured]]`` entry (a default, an example log
   line: each says why).

Scanned: README.md and docs/*.md, docs/design/*.md, docs/results/README.md. Not
scanned: the lab notes under docs/results/notes/ (dated history; each section names its
own files and commits) and docs/results.md, which ``make results`` writes with its raw
JSON lines inside it.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import re
import sys
from dataclasses import dataclass, field
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

import tomllib

REPO = Path(__file__).resolve().parents[1]
REGISTRY = "docs/results/claims.toml"
INDEX = "docs/results/README.md"  # holds table(claims) between these two lines
TABLE_BEGIN = "<!-- claims table: python -m bench.check_claims --table -->"
TABLE_END = "<!-- end of the claims table -->"
SCANNED = ("README.md", "docs/*.md", "docs/design/*.md", "docs/results/README.md")
NOT_SCANNED = ("docs/results.md",)
# a figure with a unit of measure; integers in seconds are settings ("5 s to finish")
FIGURE = re.compile(r"(?<![\w.])(?:\d[\d,]*\.\d+\s?(?:ms|us|µs|s|x|%|tok/s)"
                    r"|\d[\d,]*\s?(?:ms|us|µs|x|%|tok/s))(?![\w/])")
# a printed number (not the digit of a name such as EP2)
NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?")


@dataclass
class Claim:
    """One printed figure and its record (see the module doc for each field)."""

    doc: str
    text: str
    records: list[str]
    value: str
    commits: list[str]
    command: str
    kind: str = "value"
    where: dict[str, Any] = field(default_factory=dict)
    pointer: str | None = None
    count: int | None = None
    record_commit: str | None = None
    note: str = ""


def dig(row: Any, dotted: str) -> Any:
    """``row["a"]["b"]`` for ``"a.b"``; None where a key is missing."""
    for key in dotted.split("."):
        if not isinstance(row, dict) or key not in row:
            return None
        row = row[key]
    return row


def matches(row: dict, where: dict[str, Any]) -> bool:
    """Whether ``row`` passes every condition: a value, a list of values, or ``"re:..."``."""
    for key, want in where.items():
        got = dig(row, key)
        if isinstance(want, list):
            if got not in want:
                return False
        elif isinstance(want, str) and want.startswith("re:"):
            if got is None or not re.search(want[3:], str(got)):
                return False
        elif got != want:
            return False
    return True


def with_commits(rows: list[Any]) -> list[dict]:
    """The dict rows, each given the commit of the last meta row before it where it
    names none."""
    out, meta = [], None
    for row in rows:
        if not isinstance(row, dict):
            continue
        if row.get("section") == "meta":
            meta = row.get("commit")
        out.append(row if row.get("commit") else {**row, "commit": meta})
    return out


def load_rows(root: Path, claim: Claim) -> tuple[list[dict], list[str]]:
    """(every row of the claim's records, the problems met reading them)."""
    rows: list[dict] = []
    problems = []
    for pattern in claim.records:
        paths = sorted(glob.glob(str(root / pattern)))
        if not paths:
            problems.append(f"record {pattern} does not exist")
        for path in paths:
            if claim.record_commit and claim.record_commit not in Path(path).name:
                problems.append(f"record {Path(path).name} is not named by "
                                f"record_commit {claim.record_commit}")
            text = Path(path).read_text()
            if claim.pointer is not None:
                data = dig(json.loads(text), claim.pointer)
                if not isinstance(data, list):
                    problems.append(f"{pattern}: no list at {claim.pointer}")
                    continue
                rows += with_commits(data)
            else:
                rows += with_commits([json.loads(line) for line in text.splitlines()
                                      if line.startswith("{")])
    return rows, problems


def decimals(printed: str) -> int:
    return len(printed.split(".")[1]) if "." in printed else 0


def same(printed: str, value: Any) -> bool:
    """Whether ``value`` rounds to the printed number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return False
    want = Decimal(printed.replace(",", ""))
    # half up, on the value as written in the record (23.595 prints as 23.60)
    got = Decimal(repr(float(value))).quantize(Decimal(1).scaleb(-decimals(printed)),
                                               rounding=ROUND_HALF_UP)
    return got == want


def check_claim(root: Path, claim: Claim, doc_text: str) -> list[str]:
    """The problems of one claim (empty: it holds)."""
    where = f"{claim.doc}: {claim.text!r}"
    if claim.text not in doc_text:
        return [f"{where}: not in the doc"]
    if not claim.command.strip():
        return [f"{where}: no command"]
    rows, problems = load_rows(root, claim)
    if problems:
        return [f"{where}: {p}" for p in problems]
    picked = [r for r in rows if matches(r, claim.where)]
    if not picked:
        return [f"{where}: no row of {claim.records} matches {claim.where}"]
    out = []
    if claim.count is not None and len(picked) != claim.count:
        out.append(f"{where}: {len(picked)} rows match, the claim says {claim.count}")
    values = [dig(r, claim.value) for r in picked]
    printed = NUMBER.findall(claim.text)
    if claim.kind == "range":
        nums = [v for v in values if isinstance(v, (int, float))]
        if len(printed) < 2 or len(nums) != len(values):
            out.append(f"{where}: want a range a-b over numbers, got {values}")
        elif not (same(printed[0], min(nums)) and same(printed[1], max(nums))):
            out.append(f"{where}: the records span {min(nums)}-{max(nums)} "
                       f"({len(nums)} rows)")
    elif claim.kind == "values":
        if len(printed) != len(values) or not all(
                same(p, v) for p, v in zip(sorted(printed, key=lambda s: float(
                    s.replace(",", ""))), sorted(values), strict=True)):
            out.append(f"{where}: the records read {sorted(values)}")
    elif claim.kind == "value":
        if len(set(map(str, values))) != 1 or not printed or not same(printed[0], values[0]):
            out.append(f"{where}: the records read {values}")
    else:
        out.append(f"{where}: unknown kind {claim.kind!r}")
    for r in picked:
        r = r if r.get("commit") else {**r, "commit": claim.record_commit}
        if not r.get("commit"):
            out.append(f"{where}: a row names no commit")
            break
        if not any(str(r["commit"]).startswith(c) for c in claim.commits):
            out.append(f"{where}: a row's commit {r['commit']} is not in {claim.commits}")
            break
    return out


def table(claims: list[Claim]) -> str:
    """The claims as a Markdown table: each figure beside its record, commit and command."""
    def cell(x: str) -> str:
        return x.replace("|", "\\|")
    rows = ["| doc | figure | record | commit | command |", "|---|---|---|---|---|"]
    for c in claims:
        records = ", ".join(f"`{r}`" for r in c.records)
        if c.pointer:
            records += f" (`{c.pointer}`)"
        rows.append(f"| {c.doc} | {cell(c.text)} | {records} | {', '.join(c.commits)} | "
                    f"`{cell(c.command)}` |")
    return "\n".join([TABLE_BEGIN, *rows, TABLE_END])


def code_free(text: str) -> str:
    """``text`` with fenced code blocks blanked (same offsets)."""
    return re.sub(r"```.*?```", lambda m: re.sub(r"[^\n]", " ", m.group(0)), text,
                  flags=re.S)


def unclaimed_figures(doc: str, text: str, covered: list[str]) -> list[str]:
    """Figures in ``text`` (the doc ``doc``) outside every covered text's occurrences."""
    spans = []
    for c in covered:
        start = 0
        while (i := text.find(c, start)) >= 0:
            spans.append((i, i + len(c)))
            start = i + 1
    out = []
    for m in FIGURE.finditer(code_free(text)):
        if not any(a <= m.start() and m.end() <= b for a, b in spans):
            line = text.count("\n", 0, m.start()) + 1
            out.append(f"{doc}:{line}: figure {m.group(0)!r} names no record "
                       f"(add it to {REGISTRY}, or drop it)")
    return out


def scanned_docs(root: Path) -> list[str]:
    docs: list[str] = []
    for pattern in SCANNED:
        docs += sorted(str(Path(p).relative_to(root)) for p in glob.glob(str(root / pattern)))
    return [d for d in dict.fromkeys(docs) if d not in NOT_SCANNED]


def check(root: Path = REPO) -> tuple[list[str], int]:
    """(every problem, the number of claims) for the tree at ``root``."""
    registry = tomllib.loads((root / REGISTRY).read_text())
    claims = [Claim(**c) for c in registry.get("claim", [])]
    allowed = registry.get("not_measured", [])
    problems = []
    texts: dict[str, str] = {}
    for doc in {c.doc for c in claims} | set(scanned_docs(root)):
        path = root / doc
        texts[doc] = path.read_text() if path.is_file() else ""
    for claim in claims:
        problems += check_claim(root, claim, texts[claim.doc])
    for a in allowed:
        if not a.get("why"):
            problems.append(f"{a['doc']}: {a['text']!r}: a not_measured entry says no why")
        elif a["text"] not in texts.get(a["doc"], ""):
            problems.append(f"{a['doc']}: {a['text']!r}: not_measured, but not in the doc")
    if table(claims) not in texts.get(INDEX, ""):
        problems.append(f"{INDEX}: its claims table is not the registry's (write it with "
                        "`python -m bench.check_claims --table`)")
    for doc in scanned_docs(root):
        # the index's table repeats every claim's figure
        covered = [c.text for c in claims if c.doc == doc or doc == INDEX]
        covered += [a["text"] for a in allowed if a["doc"] == doc]
        problems += unclaimed_figures(doc, texts[doc], covered)
    return problems, len(claims)


def main(argv: list[str] | None = None) -> int:
    """Print each problem on one line; exit 1 if there is any."""
    ap = argparse.ArgumentParser(prog="python -m bench.check_claims",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=str(REPO), help="the tree to check (default: this)")
    ap.add_argument("--table", action="store_true",
                    help=f"print the claims table for {INDEX} and exit")
    args = ap.parse_args(argv)
    if args.table:
        registry = tomllib.loads((Path(args.root) / REGISTRY).read_text())
        print(table([Claim(**c) for c in registry.get("claim", [])]))
        return 0
    problems, n = check(Path(args.root))
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        print(f"check_claims: {len(problems)} problems", file=sys.stderr)
        return 1
    print(f"check_claims: {n} claims, each figure of {len(scanned_docs(Path(args.root)))} "
          "docs has its record")
    return 0


if __name__ == "__main__":
    sys.exit(main())
