"""The epochs one rank of an elastic group has committed, in order.

Each entry is (boundary, epoch, active): ops with sequence number ``>= boundary`` run in
``epoch``'s inner group with members ``active`` (until the next entry's boundary). The
group's state appends under its lock; readers (the op path, the peer channels) only read.
"""

from __future__ import annotations


class EpochLog:
    """Committed epochs of one group on this rank, oldest first.

    Args:
        epoch: the epoch the rank registered in; active: its active slots. Both cover
            every op from sequence number 0 until the first commit.
    """

    def __init__(self, epoch: int, active: tuple[int, ...]) -> None:
        self._entries: list[tuple[int, int, tuple[int, ...]]] = [(0, epoch, active)]

    def add(self, boundary: int, epoch: int, active: tuple[int, ...]) -> None:
        """Record a committed epoch whose ops start at sequence number ``boundary``."""
        self._entries.append((boundary, epoch, active))

    def covering(self, seq: int) -> tuple[int, tuple[int, ...]]:
        """(epoch, active) of the newest epoch whose boundary is at or before op ``seq``."""
        best = max((e for e in self._entries if e[0] <= seq), key=lambda e: e[1],
                   default=self._entries[0])
        return best[1], best[2]

    @property
    def current(self) -> int:
        """The newest committed epoch."""
        return self._entries[-1][1]

    def mark(self) -> int:
        """A position in the log now, for `left_since`."""
        return len(self._entries)

    def left_since(self, slot: int, mark: int) -> bool:
        """True if ``slot`` was out of the active set in an epoch committed after ``mark``
        (a `mark` value)."""
        return any(slot not in active for _, _, active in self._entries[mark:])
