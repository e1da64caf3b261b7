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


def checkpoint_without(src: Path, dst: Path, key: str) -> Path:
    """:func:`linked_checkpoint` of ``src`` whose index no longer lists the tensor
    ``key`` (which it must list): a loader asked for it fails. Returns ``dst``."""

    def drop(index: dict[str, Any]) -> dict[str, Any]:
        assert key in index["weight_map"], key
        return {**index, "weight_map": {k: v for k, v in index["weight_map"].items()
                                        if k != key}}

    return linked_checkpoint(src, dst, "model.safetensors.index.json", drop)
