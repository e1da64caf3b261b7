"""Numbers the docs state about the test suite match the suite (they come from a run)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import collected_in_session

pytestmark = pytest.mark.timeout(150)


def test_readme_count_of_the_serve_tests_is_the_collected_count(request):
    """The README's "N passed" for the serve test files is their real number of tests."""
    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    m = re.search(r"`pytest (tests/test_serve_cli\.py[^`]*)` gave (\d+) passed", readme)
    assert m, "README lost the serve tests' run line"
    files, claimed = m.group(1).split(), int(m.group(2))
    # this session collected them already (the whole suite ran): no second collection
    here = collected_in_session(request.config, [root / f for f in files])
    if here is not None:
        assert here == claimed
        return
    p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                        "-p", "no:cacheprovider", *files], capture_output=True, text=True,
                       cwd=root, timeout=120)
    collected = re.search(r"(\d+) tests? collected", p.stdout)
    assert collected, p.stdout[-2000:] + p.stderr[-2000:]
    assert int(collected.group(1)) == claimed
