"""A checkpoint directory copied as symlinks, with one JSON file edited (not a test module)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def linked_checkpoint(src: Path, dst: Path, json_name: str | None = None,
                      edit: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> Path:
    """``dst`` (made if missing) with every file of the checkpoint directory ``src``
    symlinked, except ``json_name``, which is written as ``edit`` of its parsed content.
    Returns ``dst``."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != json_name:
            (dst / f.name).symlink_to(f)
    if json_name is not None:
        data = json.loads((src / json_name).read_text())
        (dst / json_name).write_text(json.dumps(edit(data) if edit else data))
    return dst
