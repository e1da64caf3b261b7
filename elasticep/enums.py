"""The base of every mode enum (a flag's choices, a slot state, a policy's actions).

Below every other module, so the config, the membership service and the launcher share
it without importing each other.
"""

from __future__ import annotations

from enum import Enum


class StrEnum(str, Enum):
    """A mode: compares equal to its string, prints as it, and is JSON's string (as
    Python 3.11's ``enum.StrEnum``, which 3.10 lacks)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)
