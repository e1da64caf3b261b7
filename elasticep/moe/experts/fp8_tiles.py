"""Tile choices of the FP8 expert kernels, from measured tables shipped per device.

The FP8 decode kernels (:mod:`elasticep.moe.experts.fp8_rows`, a GEMV per row, and
:mod:`elasticep.moe.experts.fp8_sorted`, rows grouped by slot on tensor cores) read the
experts' weights once per step; how close they come to the copy bandwidth depends on
their tile (block of output features, rows per ``tl.dot``, warps, pipeline stages), and
the best tile depends on the expert shape, the rows and the GPU. Like vLLM's fused-MoE
configs (JSON files keyed by shape and device, written by a tuning script), the tiles
come from tables measured by ``python -m bench.fp8_decode_sweep`` and shipped in
``tile_configs/<device slug>.json``; with no file for the device, or no entry for the
shape, every kernel keeps its first-guess tile (:data:`DEFAULTS`).

The choice is made on the host from shapes alone (no autotuning, no sync): the kernels
run inside CUDA graphs captured at start, so a launch must take the same tile every
time it is replayed.

The prefill kernels of :mod:`elasticep.moe.experts.fp8_tiled` (W8A8 grouped GEMMs on
FP8 tensor cores) take theirs from the same tables (``python -m bench.fp8_expert_prefill
--sweep --write-table``): ``w8a8_gate_up`` (its output block is one 128-column scale
group, so ``block`` is 128) and ``w8a8_down`` (``block`` is its output features a
program), each with its own ``block_m`` (rows of one slot a program). A grouped GEMM
larger than the largest measured bucket only has more tiles of the same shape, so it
takes that bucket's entry (the decode kernels fall back to their defaults there).

A table file is ``{"device": name, "source": text, "entries": [entry, ...]}``; an entry
is ``{"kernel", "hidden", "inter", "bucket", "block", "num_warps"}`` plus
``"block_m"`` (the sorted kernels' rows per dot tile, required there, absent else),
``"num_stages"`` (optional; Triton's default when absent or null) and ``"measured"``
(optional free-form record of the sweep). ``bucket`` is the row count of the per-row
kernels and the rows per slot (a float) of the sorted ones: an entry serves every
launch whose value is above the next smaller bucket of the same kernel and shape and at
most its own.
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

TABLE_DIR = Path(__file__).with_name("tile_configs")
ROWS_KERNELS = ("fp8_rows_gate_up", "fp8_rows_down")
SORTED_KERNELS = ("fp8_sorted_gate_up", "fp8_sorted_down")
W8A8_KERNELS = ("w8a8_gate_up", "w8a8_down")
KERNELS = ROWS_KERNELS + SORTED_KERNELS + W8A8_KERNELS
# rows per dot tile: the sorted and W8A8 kernels take one, the per-row ones none
_BLOCK_M_KERNELS = SORTED_KERNELS + W8A8_KERNELS
# the W8A8 gate/up kernel's output block: one 128-column group of the intermediate
W8A8_GATE_UP_BLOCK = 128
_REQUIRED = {"kernel", "hidden", "inter", "bucket", "block", "num_warps"}
_OPTIONAL = {"block_m", "num_stages", "measured"}


class TileTableError(ValueError):
    """A tile table file that does not parse as the module describes."""


@dataclass(frozen=True)
class Tile:
    """One launch configuration of an FP8 decode kernel.

    Attributes:
        block: output features a program computes (``BLOCK_I`` of gate/up, ``BLOCK_O``
            of down, ``BLOCK_N`` of the W8A8 down kernel).
        num_warps: warps a program.
        block_m: rows per ``tl.dot`` tile (sorted and W8A8 kernels only, else None).
        num_stages: Triton's software-pipelining depth, or None for Triton's default.
    """

    block: int
    num_warps: int
    block_m: int | None = None
    num_stages: int | None = None

    def launch_options(self) -> dict[str, int]:
        """The launch keywords beyond the block sizes: ``num_warps``, and
        ``num_stages`` when set (so an unset one launches exactly as before)."""
        opts = {"num_warps": self.num_warps}
        if self.num_stages is not None:
            opts["num_stages"] = self.num_stages
        return opts


# The first-guess tiles, used wherever no measured entry applies. The sorted ones are
# the bf16 sorted kernels' tiles (sorted_experts.GATE_UP_TILE without BLOCK_H: the FP8
# kernels' reduction chunk is one 128-column scale block).
DEFAULTS = {
    "fp8_rows_gate_up": Tile(8, 4),
    "fp8_rows_down": Tile(32, 4),
    "fp8_sorted_gate_up": Tile(64, 4, block_m=16),
    "fp8_sorted_down": Tile(64, 4, block_m=16),
    # fp8_tiled's first tiles, kept where no table applies
    "w8a8_gate_up": Tile(W8A8_GATE_UP_BLOCK, 8, block_m=128, num_stages=3),
    "w8a8_down": Tile(128, 8, block_m=128, num_stages=3),
}


@dataclass(frozen=True)
class Entry:
    """One measured table row: the tile of ``kernel`` at ``(hidden, inter)`` for
    launches up to ``bucket`` (rows, or rows per slot for the sorted kernels)."""

    kernel: str
    hidden: int
    inter: int
    bucket: float
    tile: Tile


def device_slug(name: str) -> str:
    """The table file stem of a device name: ``"NVIDIA H100 80GB HBM3"`` ->
    ``"nvidia_h100_80gb_hbm3"``."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def table_path(device_name: str, table_dir: Path = TABLE_DIR) -> Path:
    """Where the table of ``device_name`` is shipped."""
    return table_dir / f"{device_slug(device_name)}.json"


def bucket_value(kernel: str, rows: int, slots: int) -> float:
    """The value a launch is bucketed by: ``rows`` for the per-row kernels, ``rows /
    slots`` (pairs a slot) for the sorted and W8A8 ones."""
    return float(rows) if kernel in ROWS_KERNELS else rows / max(slots, 1)


# a program is at most 1024 threads (CUDA's block limit), so 32 warps of 32
MAX_NUM_WARPS = 32


def _positive_int(entry: dict, key: str, where: str, power_of_two: bool = False,
                  most: int | None = None) -> int:
    v = entry[key]
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0 or (
            power_of_two and v & (v - 1)) or (most is not None and v > most):
        kind = "a power of two" if power_of_two else "a positive integer"
        kind += "" if most is None else f" at most {most}"
        raise TileTableError(f"{where}: {key} must be {kind}, got {v!r}")
    return v


def _entry(raw: object, where: str) -> Entry:
    if not isinstance(raw, dict):
        raise TileTableError(f"{where}: an entry must be an object, got {raw!r}")
    missing, unknown = _REQUIRED - raw.keys(), raw.keys() - _REQUIRED - _OPTIONAL
    if missing or unknown:
        raise TileTableError(f"{where}: missing keys {sorted(missing)}, unknown keys "
                             f"{sorted(unknown)}")
    kernel = raw["kernel"]
    if kernel not in KERNELS:
        raise TileTableError(f"{where}: kernel {kernel!r} is not one of {list(KERNELS)}")
    bucket = raw["bucket"]
    if isinstance(bucket, bool) or not isinstance(bucket, (int, float)) or not (
            0 < bucket < math.inf):  # Python's json reads "Infinity"
        raise TileTableError(f"{where}: bucket must be a positive number, got {bucket!r}")
    sorted_kernel = kernel in _BLOCK_M_KERNELS
    if sorted_kernel != (raw.get("block_m") is not None):
        raise TileTableError(f"{where}: block_m is required for the sorted and W8A8 "
                             f"kernels and refused for the per-row ones ({kernel})")
    stages = raw.get("num_stages")
    tile = Tile(_positive_int(raw, "block", where, True),
                _positive_int(raw, "num_warps", where, True, MAX_NUM_WARPS),
                _positive_int(raw, "block_m", where, True) if sorted_kernel else None,
                None if stages is None else _positive_int(raw, "num_stages", where))
    if sorted_kernel and tile.block_m < 16:
        raise TileTableError(f"{where}: block_m must be at least 16 (tl.dot), got "
                             f"{tile.block_m}")
    if kernel == "w8a8_gate_up" and tile.block != W8A8_GATE_UP_BLOCK:
        raise TileTableError(f"{where}: w8a8_gate_up's block is one scale group, "
                             f"{W8A8_GATE_UP_BLOCK}, got {tile.block}")
    return Entry(kernel, _positive_int(raw, "hidden", where),
                 _positive_int(raw, "inter", where), float(bucket), tile)


def parse_table(text: str, source: str) -> list[Entry]:
    """The entries of a table file's text.

    Args:
        text: the file's JSON text (the module's format).
        source: the file's name, for the errors.

    Raises:
        TileTableError: not JSON, not the format, or two entries for one
            (kernel, hidden, inter, bucket); the message names ``source``.
    """
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise TileTableError(f"{source}: not JSON ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("entries"), list):
        raise TileTableError(f"{source}: a tile table is an object with an 'entries' list")
    entries = [_entry(raw, f"{source} entry {i}") for i, raw in enumerate(doc["entries"])]
    keys = [(e.kernel, e.hidden, e.inter, e.bucket) for e in entries]
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise TileTableError(f"{source}: two entries for {dup}")
    return entries


def select(entries: list[Entry], kernel: str, hidden: int, inter: int,
           value: float) -> Tile | None:
    """The tile of the entry with the smallest bucket ``>= value`` among those of
    ``kernel`` at ``(hidden, inter)``; past the largest bucket, a W8A8 kernel takes
    that one's and the others None (as with no entry)."""
    mine = [e for e in entries if (e.kernel, e.hidden, e.inter) == (kernel, hidden, inter)]
    fits = [e for e in mine if e.bucket >= value]
    if fits:
        return min(fits, key=lambda e: e.bucket).tile
    if mine and kernel in W8A8_KERNELS:
        return max(mine, key=lambda e: e.bucket).tile
    return None





def table_json(device_name: str, entries: list[Entry], source: str,
               measured: dict[tuple[str, int, int, float], dict] | None = None) -> str:
    """A table file's text for ``entries`` (what :func:`parse_table` reads back).

    Args:
        device_name: the device the entries were measured on.
        entries: the rows to write.
        source: how they were made (a command and commit).
        measured: optional record per ``(kernel, hidden, inter, bucket)``, written as
            the entry's ``measured``.
    """
    rows = []
    for e in sorted(entries, key=lambda e: (e.kernel, e.hidden, e.inter, e.bucket)):
        raw = {"kernel": e.kernel, "hidden": e.hidden, "inter": e.inter,
               "bucket": int(e.bucket) if float(e.bucket).is_integer() else e.bucket,
               "block": e.tile.block, "num_warps": e.tile.num_warps}
        if e.tile.block_m is not None:
            raw["block_m"] = e.tile.block_m
        if e.tile.num_stages is not None:
            raw["num_stages"] = e.tile.num_stages
        rec = (measured or {}).get((e.kernel, e.hidden, e.inter, e.bucket))
        if rec is not None:
            raw["measured"] = rec
        rows.append(raw)
    return json.dumps({"device": device_name, "source": source, "entries": rows}, indent=1) + "\n"


def write_merged(path: Path, device_name: str, entries: list[Entry], source: str,
                 measured: dict[tuple[str, int, int, float], dict]) -> Path:
    """Write a sweep's ``entries`` into a table file, keeping the entries (and their
    ``measured`` records) of every (kernel, expert shape) the sweep did not cover, so a
    prefill sweep keeps the decode kernels' rows and the other way round, and a sweep of
    one shape keeps another shape's.

    Args:
        path: a ``.json`` file, or a directory (made if missing) to hold
            ``<device slug>.json``.
        device_name, source, measured: as :func:`table_json`'s (``source`` is joined
            to the file's own where it keeps entries).

    Returns:
        The file written.

    Raises:
        TileTableError: the file there is not UTF-8 or is malformed.
    """
    if path.suffix != ".json":
        path.mkdir(parents=True, exist_ok=True)
        path = path / f"{device_slug(device_name)}.json"
    swept = {(e.kernel, e.hidden, e.inter) for e in entries}
    kept: list[Entry] = []
    measured = dict(measured)
    if path.is_file():
        text = _read_text(path)
        entries_there = parse_table(text, str(path))  # validates before json.loads
        doc = json.loads(text)
        for e, raw in zip(entries_there, doc["entries"], strict=True):
            if (e.kernel, e.hidden, e.inter) in swept:
                continue
            kept.append(e)
            if "measured" in raw:
                measured[(e.kernel, e.hidden, e.inter, e.bucket)] = raw["measured"]
        earlier = doc.get("source") or ""
        if kept and earlier and source not in earlier.split("; "):
            source = f"{earlier}; {source}"
        elif kept and earlier:  # a sweep writing after each case: its source once
            source = earlier
    path.write_text(table_json(device_name, kept + list(entries), source, measured))
    return path


def check_table_targets(paths: list[Path], device_name: str | None) -> None:
    """Each path can take :func:`write_merged`'s entries: a ``.json`` file that is
    absent or a valid table, or a directory (or none yet) whose ``<device slug>.json``
    is; for a sweep to check before its minutes of measuring, since
    :func:`write_merged` refuses a malformed file only when it writes.

    Args:
        paths: ``--write-table`` values.
        device_name: the device's name, or None before it is known (directories are
            then skipped).

    Raises:
        TileTableError: a table there is not UTF-8 or is malformed.
        OSError: a path that is neither a ``.json`` file nor a directory.
    """
    for path in paths:
        if path.suffix != ".json":
            if path.exists() and not path.is_dir():
                raise NotADirectoryError(f"{path}: neither a .json file nor a directory")
            if device_name is None:
                continue
            path = table_path(device_name, path)
        if path.exists():
            read_table(path)


@functools.cache
def load_table(path: Path) -> tuple[Entry, ...]:
    """The entries of the table file at ``path`` (read once); () when there is none.

    Raises:
        TileTableError: the file exists but is not UTF-8 or is malformed
            (:func:`parse_table`).
    """
    if not path.is_file():
        return ()
    return tuple(read_table(path))


def read_table(path: Path) -> list[Entry]:
    """The entries of the table file at ``path``, read now (uncached).

    Raises:
        OSError: no file there.
        TileTableError: not UTF-8, or malformed (:func:`parse_table`).
    """
    return parse_table(_read_text(path), str(path))


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise TileTableError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def device_name_of(device: torch.device) -> str | None:
    """The name tables are keyed by for tensors on ``device``; None off CUDA (the
    Triton interpreter on CPU tensors takes the defaults)."""
    if device.type != "cuda":
        return None
    return _device_name(device.index if device.index is not None else
                        torch.cuda.current_device())


@functools.lru_cache(maxsize=4096)
def decode_tile(kernel: str, hidden: int, inter: int, value: float,
                device_name: str | None, table_dir: Path = TABLE_DIR) -> Tile:
    """The tile ``kernel`` launches with at expert shape ``(hidden, inter)`` and bucket
    value ``value`` (:func:`bucket_value`) on ``device_name``: the shipped table's
    entry (:func:`select`), else :data:`DEFAULTS`. Host only, cached.

    Raises:
        KeyError: ``kernel`` is not one of :data:`KERNELS`.
        TileTableError: the device's table file is malformed.
    """
    default = DEFAULTS[kernel]
    if device_name is None:
        return default
    entries = list(load_table(table_path(device_name, table_dir)))
    return select(entries, kernel, hidden, inter, value) or default


def launch_tiles(kernels: tuple[str, str], hidden: int, inter: int, rows: int, slots: int,
                 device: torch.device) -> tuple[Tile, Tile]:
    """The gate/up and down tiles of one launch pair (``kernels`` names them) for
    ``rows`` rows over ``slots`` slots on ``device`` (:func:`decode_tile`)."""
    name = device_name_of(device)
    gu, dn = (decode_tile(k, hidden, inter, bucket_value(k, rows, slots), name)
              for k in kernels)
    return gu, dn
