"""Session plumbing: the number of tests collected per test file in this session, for
tests/test_docs_numbers.py (it would otherwise collect those files again in a pytest
subprocess). Only files collected whole count: a run named them, or a folder above them,
without ``::`` selection."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

COLLECTED = pytest.StashKey[Counter]()
WHOLE = pytest.StashKey[list]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[COLLECTED] = Counter()
    args = config.args or [str(Path(config.rootpath, p)) for p in config.getini("testpaths")]
    config.stash[WHOLE] = [Path(config.invocation_params.dir, a).resolve()
                           for a in args if "::" not in a]


def pytest_itemcollected(item: pytest.Item) -> None:
    # before -k / -m / --deselect: the count `pytest --collect-only FILE` prints
    item.config.stash[COLLECTED][item.path] += 1


def collected_in_session(config: pytest.Config, files: list[Path]) -> int | None:
    """Tests this session collected from ``files`` (each collected whole), or None if
    some file was not (then count them another way)."""
    counts, whole = config.stash[COLLECTED], config.stash[WHOLE]
    files = [f.resolve() for f in files]
    if not all(counts[f] and any(f == w or w in f.parents for w in whole) for f in files):
        return None
    return sum(counts[f] for f in files)
