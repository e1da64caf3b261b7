"""The chaos invariants, as pure checks over what a trial recorded.

* requests: every request completed with the fault-free greedy text, or got a clear
  error (an HTTP status with a message); a client timeout is a hang, a dropped
  connection or a short stream without an error is a silent loss;
* membership: at each epoch every rank that logged its view of the active set agrees,
  and agrees with the coordinator's committed membership of that epoch;
* processes: no pid the run started or saw is left alive (checked by the runner).

Worker views come from the worker logs (``rank<r>.log``), whose lines carry
``rank=R epoch=E`` and, on every placement reconciliation, ``active [..]``; the
coordinator's commits come from serve's log.
"""

from __future__ import annotations

import re
from pathlib import Path

from elasticep_testkit.harness.load import RequestRecord

_VIEW = re.compile(r"rank=(\d+) epoch=(\d+) .*placement reconciled.* active \[([\d, ]*)\]")
_COMMIT = re.compile(r"group world commit epoch (\d+) .*'active': \[([\d, ]*)\]")
# client errors that mean the server never answered clearly
_UNCLEAR = ("APITimeoutError", "ReadTimeout", "APIConnectionError", "RemoteProtocolError")


def _ranks(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.replace(" ", "").split(",") if x)


def worker_views(log_dir: Path) -> dict[int, dict[int, set[tuple[int, ...]]]]:
    """epoch -> rank -> the active sets that rank logged at that epoch."""
    views: dict[int, dict[int, set[tuple[int, ...]]]] = {}
    for path in sorted(log_dir.glob("rank*.log")):
        for m in _VIEW.finditer(path.read_text(errors="replace")):
            rank, epoch = int(m.group(1)), int(m.group(2))
            views.setdefault(epoch, {}).setdefault(rank, set()).add(_ranks(m.group(3)))
    return views


def coordinator_commits(serve_log: Path) -> dict[int, tuple[int, ...]]:
    """epoch -> the active set the coordinator committed (WORLD group)."""
    text = serve_log.read_text(errors="replace")
    return {int(m.group(1)): _ranks(m.group(2)) for m in _COMMIT.finditer(text)}


def check_membership(views: dict[int, dict[int, set[tuple[int, ...]]]],
                     commits: dict[int, tuple[int, ...]], epochs: range) -> list[str]:
    """Violations of "every rank's view agrees at each epoch" for ``epochs``."""
    out = []
    for epoch in epochs:
        seen = {v for per_rank in views.get(epoch, {}).values() for v in per_rank}
        if len(seen) > 1:
            out.append(f"epoch {epoch}: ranks disagree on the active set: "
                       f"{ {r: sorted(v) for r, v in views[epoch].items()} }")
        elif seen and epoch in commits and seen != {commits[epoch]}:
            out.append(f"epoch {epoch}: ranks saw active {sorted(seen)[0]} but the "
                       f"coordinator committed {commits[epoch]}")
    return out


def check_requests(records: list[RequestRecord], reference: dict[int, str],
                   max_tokens: int) -> tuple[list[str], list[str]]:
    """Violations and clear errors of one trial's requests.

    Returns:
        (violations, clear_errors): hangs, silent losses and wrong texts are
        violations; an error the server answered with a status and message is not.
    """
    violations, clear = [], []
    for r in records:
        if r.error is not None:
            if any(k in r.error for k in _UNCLEAR):
                violations.append(f"request {r.prompt_idx}: no clear answer after "
                                  f"{len(r.token_times)} tokens: {r.error[:200]}")
            else:
                clear.append(r.error[:200])
        elif not r.complete(max_tokens):
            violations.append(f"request {r.prompt_idx}: stream ended after "
                              f"{len(r.token_times)}/{max_tokens} tokens with no error "
                              f"(finish {r.finish_reason})")
        elif r.text != reference[r.prompt_idx]:
            ref = reference[r.prompt_idx]
            at = next((i for i, (a, b) in enumerate(zip(r.text, ref, strict=False)) if a != b),
                      min(len(r.text), len(ref)))
            violations.append(f"request {r.prompt_idx}: text differs from the fault-free run "
                              f"at char {at}: {r.text[at:at + 30]!r} vs {ref[at:at + 30]!r}")
    return violations, clear
