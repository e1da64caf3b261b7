"""The chaos invariants, as pure checks over what a trial recorded.

* requests: every request completed with the fault-free greedy text, and at least a
  minimum number completed. While the schedule leaves a rank to serve, any client error
  is a violation (the survivors must answer every request); only a schedule that can
  take every rank out may end requests with a clear error (an HTTP status with a
  message). A client timeout is a hang, a dropped connection or a short stream without
  an error is a silent loss: violations always;
* membership: at each epoch every rank that logged its view of the active set agrees,
  and agrees with the coordinator's committed membership of that epoch. The check is
  never vacuous: every epoch the trial moved to must have a commit line in serve's log,
  and some worker must have logged its view in one of them (a log format that the
  patterns no longer match fails here, instead of passing with nothing compared);
* processes: no pid the run started or saw is left alive (checked by the runner).

Worker views come from the worker logs (``rank<r>.log``), whose lines carry
``rank=R epoch=E`` and, on every placement reconciliation, ``active [..]``; the
coordinator's commits come from serve's log. A 2-node deployment with standby
coordinators has several of each (one log directory and one serve log per node and
incarnation: whichever replica leads logs its commits in its own node's log); the
readers take them all.
"""

from __future__ import annotations

import re
from pathlib import Path

from elasticep_testkit.harness.load import RequestRecord

_VIEW = re.compile(r"rank=(\d+) epoch=(\d+) .*placement reconciled.* active \[([\d, ]*)\]")
_COMMIT = re.compile(r"^(\S+ \S+) .*group world commit epoch (\d+) .*'active': \[([\d, ]*)\]",
                     re.M)
_ANNOUNCE = re.compile(r"group world announce epoch (\d+) ")
# client errors that mean the server never answered clearly
_UNCLEAR = ("APITimeoutError", "ReadTimeout", "APIConnectionError", "RemoteProtocolError")


def _ranks(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.replace(" ", "").split(",") if x)


def worker_views(*log_dirs: Path) -> dict[int, dict[int, set[tuple[int, ...]]]]:
    """epoch -> rank -> the active sets that rank logged at that epoch, over the
    ``rank*.log`` files of every directory given."""
    views: dict[int, dict[int, set[tuple[int, ...]]]] = {}
    for log_dir in log_dirs:
        for path in sorted(log_dir.glob("rank*.log")):
            for m in _VIEW.finditer(path.read_text(errors="replace")):
                rank, epoch = int(m.group(1)), int(m.group(2))
                views.setdefault(epoch, {}).setdefault(rank, set()).add(_ranks(m.group(3)))
    return views


def coordinator_commits(*serve_logs: Path) -> dict[int, tuple[int, ...]]:
    """epoch -> the active set the coordinator committed (WORLD group).

    Over several logs the latest line of an epoch wins. With a membership store a
    leader logs the commit line only once the store has the epoch (a decision still
    held is logged as ``decided``, and as ``refused`` if it never goes out), so a line
    here is a commit the successor leaders also see.
    """
    lines = sorted((m.group(1), int(m.group(2)), _ranks(m.group(3)))
                   for log in serve_logs
                   for m in _COMMIT.finditer(log.read_text(errors="replace")))
    return {epoch: active for _, epoch, active in lines}


def announced_epochs(*serve_logs: Path) -> set[int]:
    """Epochs a coordinator announced for WORLD (committed or not), in any log given."""
    return {int(m.group(1)) for log in serve_logs
            for m in _ANNOUNCE.finditer(log.read_text(errors="replace"))}


def check_membership(views: dict[int, dict[int, set[tuple[int, ...]]]],
                     commits: dict[int, tuple[int, ...]], epochs: range,
                     announced: set[int] | frozenset[int] = frozenset()) -> list[str]:
    """Violations of "every rank's view agrees at each epoch" for ``epochs``.

    Args:
        views: from :func:`worker_views`.
        commits: from :func:`coordinator_commits`.
        epochs: the trial's epochs, its starting one first (``range(e0, e1 + 1)``);
            every later one must appear in ``commits`` (unless superseded), and
            ``views`` must hold at least one rank's view of one of them.
        announced: from :func:`announced_epochs`. An announced epoch that a later
            commit superseded (a death during its transition re-announces under a new
            epoch, ``registry.Transition.restart``) is never committed, rightly.
    """
    out = []
    moved = epochs[1:]
    missing = [e for e in moved if e not in commits
               and not (e in announced and any(c > e for c in commits))]
    if missing:
        out.append(f"no coordinator commit logged for epochs {missing} (the commit "
                   f"pattern matched {len(commits)} lines in all)")
    if moved and not any(views.get(e) for e in moved):
        out.append(f"no worker logged its view of the active set at epochs "
                   f"{moved.start}..{moved.stop - 1}: nothing to compare")
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
                   max_tokens: int, min_completed: int,
                   errors_allowed: bool = False) -> tuple[list[str], list[str]]:
    """Violations and clear errors of one trial's requests.

    Args:
        records: every request of the trial.
        reference: prompt index -> the fault-free greedy text.
        max_tokens: tokens of a complete answer.
        min_completed: fewer complete answers than this is a violation (the load ran).
        errors_allowed: the schedule may leave no rank to serve, so an error the server
            answered with a status and a message is not a violation.

    Returns:
        (violations, clear_errors): hangs, silent losses, wrong texts, too few
        completions and, unless ``errors_allowed``, any client error are violations;
        ``clear_errors`` lists the errors the server answered clearly.
    """
    violations, clear = [], []
    for r in records:
        if r.error is not None:
            if any(k in r.error for k in _UNCLEAR):
                violations.append(f"request {r.prompt_idx}: no clear answer after "
                                  f"{len(r.token_times)} tokens: {r.error[:200]}")
            else:
                clear.append(r.error[:200])
                if not errors_allowed:
                    violations.append(f"request {r.prompt_idx}: client error while ranks "
                                      f"were left to serve: {r.error[:200]}")
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
    completed = sum(r.complete(max_tokens) for r in records)
    if completed < min_completed:
        violations.append(f"only {completed} of {len(records)} requests completed; at "
                          f"least {min_completed} must")
    return violations, clear
