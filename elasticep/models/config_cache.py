"""The record of what :func:`~elasticep.models.config.load_model_config` read from
transformers' ``AutoConfig``, and its replay.

Importing transformers costs a process about 1.5 s of CPU, and every rank of every
deployment parses the config. So the attributes a parse reads from ``AutoConfig`` are
recorded (:class:`Recorder`) in a small JSON file per (``config.json`` bytes,
transformers version) (:func:`cache_file`), and a later process replays them
(:class:`Replay`) instead of importing transformers: the same values, read in the same
order, give the same config.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def config_cache_dir() -> Path:
    """Where :func:`~elasticep.models.config.load_model_config` records what it read
    from ``AutoConfig``: ``$ELASTICEP_CONFIG_CACHE``, else ``elasticep/config`` in the user's cache directory
    (``$XDG_CACHE_HOME``, default ``~/.cache``; not the shared temp directory, where
    another user could plant records)."""
    if env := os.environ.get("ELASTICEP_CONFIG_CACHE"):
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "elasticep", "config")


def cache_file(config_json: Path) -> Path:
    """The record of ``config_json``'s ``AutoConfig`` under this transformers version."""
    h = hashlib.sha256(config_json.read_bytes())
    h.update(importlib.metadata.version("transformers").encode())
    return config_cache_dir() / f"{h.hexdigest()[:32]}.json"


class Recorder:
    """``AutoConfig``'s config, recording each attribute read (absent ones as such)."""

    def __init__(self, cfg: Any) -> None:
        self._cfg = cfg
        self._seen: dict[str, list] = {}  # name -> [] (absent) or [value]

    def __getattr__(self, name: str) -> Any:
        try:
            value = getattr(self._cfg, name)
        except AttributeError:
            self._seen[name] = []
            raise
        self._seen[name] = [value]
        return value

    def save(self, file: Path) -> None:
        """Write the record where JSON keeps every value as it was (else write nothing);
        a write that fails leaves the next process to parse with transformers again."""
        text = json.dumps(self._seen, default=repr)
        if json.loads(text) != self._seen:  # a tuple, a non-str key, an object: not kept
            return
        with contextlib.suppress(OSError):
            file.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=file.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as out:
                out.write(text)
            os.replace(tmp, file)


class NotRecorded(Exception):
    """A replayed parse read an attribute the recorded one did not: parse afresh."""


class Replay:
    """A recorded ``AutoConfig``: the same attributes, absent where they were absent.

    Raises:
        NotRecorded: from an attribute read the record has no entry for.
    """

    def __init__(self, seen: dict[str, list]) -> None:
        self._seen = seen

    @classmethod
    def load(cls, file: Path) -> Replay | None:
        """The record in ``file``, or None (none yet, or unreadable)."""
        try:
            seen = json.loads(file.read_text())
        except (OSError, ValueError):
            return None
        return cls(seen) if isinstance(seen, dict) else None

    def __getattr__(self, name: str) -> Any:
        if name not in self._seen:
            raise NotRecorded(name)
        if not self._seen[name]:
            raise AttributeError(name)  # absent from the recorded config too
        return self._seen[name][0]
