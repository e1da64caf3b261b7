"""A launch rank that exits before it is healthy, told in one line: its exit status and
the exception that ended its worker's log, with where the whole traceback is (serve's
error line, generate's and the Python API's alike)."""

from __future__ import annotations

from pathlib import Path


class RankStartupError(RuntimeError):
    """A launch rank exited while loading; the message is :func:`loading_failure`'s.

    Attributes:
        rank: the rank that exited.
        code: its exit status (negative: killed by that signal).
    """

    def __init__(self, rank: int, code: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.code = code


def loading_failure(rank: int, code: int, log_tail: str, log_dir: Path | None = None) -> str:
    """Why ``rank`` did not come up, from its log's last lines (pure). A rank killed
    before it wrote anything (SIGKILL) gets "its log is empty", not a colon followed by
    nothing; a log that ends in a Python traceback gives only the exception's line and
    where the whole traceback is (``rank<r>.log`` in ``log_dir``); any other log (a
    rank killed by a signal midway), its last lines after a line naming that file."""
    head = f"rank {rank} exited with {code} while loading"
    if not log_tail.strip():
        return f"{head}; its log is empty"
    error = traceback_error(log_tail)
    if error is not None:
        where = f"rank{rank}.log in {log_dir}" if log_dir is not None else "its log"
        return f"{head}: {error} (traceback in {where})"
    log = "its log" if log_dir is None else f"its log (rank{rank}.log in {log_dir})"
    return f"{head}; {log} ends with:\n{log_tail}"


def traceback_error(log_tail: str) -> str | None:
    """The exception line that ends the last traceback of ``log_tail``, or None when
    the tail does not end in one (a frame line is indented; the exception is not)."""
    lines = log_tail.rstrip().splitlines()
    frames = [i for i, line in enumerate(lines) if line.startswith("  File ")]
    if not frames:
        return None
    rest = [line for line in lines[frames[-1] + 1:] if line and not line[0].isspace()]
    return " ".join(rest) if rest else None
