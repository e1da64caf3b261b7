"""The FP8 expert kernels' tile tables (:mod:`elasticep.moe.experts.fp8_tiles`):
the lookup and its fallback, refusals of malformed files, a sweep's merge into a file
that holds other kernels' rows, the kernels under ``TRITON_INTERPRET=1`` with tiles
read from a table, and the decode sweep's dry run (``bench/fp8_decode_sweep.py --device
cpu``) whose written table the lookup reads back.
"""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
from pathlib import Path

import pytest
import torch
from _interpreted import run_interpreted

from elasticep.moe.experts import fp8_tiles as tiles
from elasticep.moe.experts.fp8_tiles import (
    DEFAULTS,
    Entry,
    Tile,
    TileTableError,
    decode_tile,
    parse_table,
    table_json,
    table_path,
)

pytestmark = pytest.mark.timeout(200)
DEVICE = "Fake GPU 80GB"


def _entry(kernel="fp8_rows_gate_up", hidden=2048, inter=768, bucket=8, **kw) -> dict:
    raw = {"kernel": kernel, "hidden": hidden, "inter": inter, "bucket": bucket,
           "block": 16, "num_warps": 2}
    if kernel.startswith(("fp8_sorted", "w8a8")):
        raw["block_m"] = 32
    if kernel == "w8a8_gate_up":
        raw["block"] = 128
    return {**raw, **kw}


def _write(table_dir: Path, entries: list[dict], device: str = DEVICE) -> Path:
    path = table_path(device, table_dir)
    path.write_text(json.dumps({"device": device, "source": "test", "entries": entries}))
    return path


def test_fallback_is_the_first_guess_tiles_exactly(tmp_path):
    # the tiles the kernels launched with before any table: (BLOCK, warps), Triton's
    # default stages, and the sorted kernels' 16-row dot tiles; the W8A8 prefill kernels'
    # (BLOCK_M 128, 8 warps, 3 stages; down's 128 output features)
    assert DEFAULTS == {"fp8_rows_gate_up": Tile(8, 4), "fp8_rows_down": Tile(32, 4),
                        "fp8_sorted_gate_up": Tile(64, 4, block_m=16),
                        "fp8_sorted_down": Tile(64, 4, block_m=16),
                        "w8a8_gate_up": Tile(128, 8, block_m=128, num_stages=3),
                        "w8a8_down": Tile(128, 8, block_m=128, num_stages=3)}
    assert DEFAULTS["fp8_rows_gate_up"].launch_options() == {"num_warps": 4}
    for kernel in tiles.KERNELS:
        assert decode_tile(kernel, 2048, 768, 8.0, None) == DEFAULTS[kernel]  # CPU
        assert decode_tile(kernel, 2048, 768, 8.0, DEVICE, tmp_path) == DEFAULTS[kernel]
    assert Tile(8, 4, num_stages=2).launch_options() == {"num_warps": 4, "num_stages": 2}


def test_an_entry_is_picked_by_shape_bucket_and_device(tmp_path):
    _write(tmp_path, [_entry(bucket=8, block=16), _entry(bucket=64, block=32),
                      _entry(kernel="fp8_sorted_down", bucket=0.5, block=128, num_stages=3),
                      _entry(hidden=7168, inter=2048, bucket=64, block=4, num_warps=8)])
    assert table_path(DEVICE, tmp_path).name == "fake_gpu_80gb.json"

    def pick(kernel, value, hidden=2048, inter=768, device=DEVICE):
        return decode_tile(kernel, hidden, inter, value, device, tmp_path)

    assert pick("fp8_rows_gate_up", 1) == Tile(16, 2)  # smallest bucket >= 1
    assert pick("fp8_rows_gate_up", 8) == Tile(16, 2)
    assert pick("fp8_rows_gate_up", 9) == Tile(32, 2)
    assert pick("fp8_rows_gate_up", 65) == DEFAULTS["fp8_rows_gate_up"]  # above every bucket
    assert pick("fp8_rows_gate_up", 8, 7168, 2048) == Tile(4, 8)
    assert pick("fp8_rows_gate_up", 8, 4096, 1536) == DEFAULTS["fp8_rows_gate_up"]
    assert pick("fp8_rows_down", 8) == DEFAULTS["fp8_rows_down"]  # no entry for it
    assert pick("fp8_rows_gate_up", 8, device="Other GPU") == DEFAULTS["fp8_rows_gate_up"]
    assert pick("fp8_sorted_down", 128 / 256) == Tile(128, 2, block_m=32, num_stages=3)
    assert pick("fp8_sorted_down", 1.0) == DEFAULTS["fp8_sorted_down"]
    assert tiles.bucket_value("fp8_sorted_down", 128, 256) == 0.5
    assert tiles.bucket_value("fp8_rows_down", 8, 256) == 8


@pytest.mark.parametrize("text, says", [
    ("{not json", "not JSON"),
    (json.dumps([]), "'entries' list"),
    (json.dumps({"entries": [{**_entry(), "colour": 1}]}), "unknown keys ['colour']"),
    (json.dumps({"entries": [{k: v for k, v in _entry().items() if k != "block"}]}),
     "missing keys ['block']"),
    (json.dumps({"entries": [_entry(kernel="fp8_tiled")]}), "kernel 'fp8_tiled'"),
    (json.dumps({"entries": [_entry(block=12)]}), "block must be a power of two"),
    (json.dumps({"entries": [_entry(num_warps=True)]}), "num_warps must be a power of two"),
    (json.dumps({"entries": [_entry(bucket=0)]}), "bucket must be a positive number"),
    (json.dumps({"entries": [_entry(bucket=float("inf"))]}),  # JSON's "Infinity"
     "bucket must be a positive number, got inf"),
    (json.dumps({"entries": [_entry(num_warps=64)]}),  # 2048 threads: no launch takes it
     "num_warps must be a power of two at most 32, got 64"),
    ("\udcff{}", "not UTF-8 text"),  # written as the byte 0xff below
    (json.dumps({"entries": [_entry(block_m=16)]}), "block_m is required for the sorted"),
    (json.dumps({"entries": [_entry(kernel="fp8_sorted_gate_up", block_m=8)]}),
     "block_m must be at least 16"),
    (json.dumps({"entries": [_entry(), _entry(block=32)]}), "two entries for"),
    (json.dumps({"entries": [_entry(kernel="w8a8_gate_up", block=64)]}),
     "w8a8_gate_up's block is one scale group, 128"),
    (json.dumps({"entries": [{k: v for k, v in _entry(kernel="w8a8_down").items()
                              if k != "block_m"}]}), "block_m is required for the sorted"),
])
def test_a_malformed_table_is_refused_naming_the_file(tmp_path, text, says):
    path = table_path(DEVICE, tmp_path)
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(TileTableError, match=str(path).replace(".", r"\.")) as e:
        decode_tile("fp8_rows_gate_up", 2048, 768, 8.0, DEVICE, tmp_path)
    assert says in str(e.value)


def test_the_table_writer_round_trips():
    entries = [Entry("fp8_rows_down", 2048, 768, 16.0, Tile(64, 8, num_stages=1)),
               Entry("fp8_sorted_gate_up", 7168, 2048, 0.5, Tile(32, 4, 16)),
               Entry("fp8_sorted_gate_up", 7168, 2048, 8.0, Tile(128, 8, 32, 4))]
    measured = {("fp8_rows_down", 2048, 768, 16.0): {"us": 3.5}}
    text = table_json(DEVICE, entries, "test", measured)
    back = parse_table(text, "round trip")
    assert sorted(back, key=repr) == sorted(entries, key=repr)
    assert json.loads(text)["entries"][0]["measured"] == {"us": 3.5}


def test_a_w8a8_launch_past_the_largest_bucket_takes_it(tmp_path):
    # a larger grouped GEMM has more tiles of the same shape: the largest measured
    # bucket's tile, where the decode kernels fall back to their defaults
    _write(tmp_path, [_entry(kernel="w8a8_down", bucket=128, block=64, num_stages=4),
                      _entry(kernel="w8a8_down", bucket=512, block=256, num_warps=8)])

    def pick(value, kernel="w8a8_down"):
        return decode_tile(kernel, 2048, 768, value, DEVICE, tmp_path)

    assert pick(64) == Tile(64, 2, block_m=32, num_stages=4)
    assert pick(128) == Tile(64, 2, block_m=32, num_stages=4)
    assert pick(129) == Tile(256, 8, block_m=32)
    assert pick(4096) == Tile(256, 8, block_m=32)  # past 512
    assert pick(64, "w8a8_gate_up") == DEFAULTS["w8a8_gate_up"]  # no entry for it


def test_a_sweep_merges_into_a_file_keeping_the_other_kernels(tmp_path):
    dsv3 = _entry(kernel="w8a8_down", hidden=7168, inter=2048, bucket=256, block=128)
    path = _write(tmp_path, [{**_entry(bucket=8, block=16), "measured": {"us": 5.0}},
                             _entry(kernel="w8a8_down", bucket=512, block=64), dsv3])
    new = [Entry("w8a8_down", 2048, 768, 128.0, Tile(256, 8, 64, 3)),
           Entry("w8a8_gate_up", 2048, 768, 128.0, Tile(128, 4, 64, 2))]
    written = tiles.write_merged(tmp_path, DEVICE, new, "prefill sweep",
                                 {("w8a8_down", 2048, 768, 128.0): {"us": 9.0}})
    assert written == path
    doc = json.loads(path.read_text())
    back = parse_table(path.read_text(), "merged")
    # the decode row and its record kept, and the swept kernel's row of another shape;
    # the swept kernel's old row of the swept shape replaced
    assert sorted(back, key=repr) == sorted(
        [Entry("fp8_rows_gate_up", 2048, 768, 8.0, Tile(16, 2)),
         Entry("w8a8_down", 7168, 2048, 256.0, Tile(128, 2, 32)), *new], key=repr)
    measured = {(e["kernel"], e["hidden"]): e.get("measured") for e in doc["entries"]}
    assert measured == {("fp8_rows_gate_up", 2048): {"us": 5.0},
                        ("w8a8_down", 2048): {"us": 9.0}, ("w8a8_down", 7168): None,
                        ("w8a8_gate_up", 2048): None}
    assert doc["source"] == "test; prefill sweep"
    # a sweep writes after each case: its source is named once
    tiles.write_merged(tmp_path, DEVICE, new, "prefill sweep", {})
    assert json.loads(path.read_text())["source"] == "test; prefill sweep"
    # a fresh directory gets the device's file with only the new rows
    fresh = tiles.write_merged(tmp_path / "new", DEVICE, new, "prefill sweep", {})
    assert fresh.name == "fake_gpu_80gb.json"
    assert sorted(tiles.load_table(fresh), key=repr) == sorted(new, key=repr)


def test_the_prefill_sweep_grids_hold_the_first_guesses():
    from bench.fp8_expert_prefill import GRID_DOWN, GRID_GATE_UP
    assert DEFAULTS["w8a8_gate_up"] in GRID_GATE_UP and DEFAULTS["w8a8_down"] in GRID_DOWN
    for tile in GRID_GATE_UP:  # every candidate is a tile the table accepts
        parse_table(tiles.table_json(DEVICE, [Entry("w8a8_gate_up", 1, 1, 1.0, tile)], "t"), "g")


def test_the_package_ships_the_tables():
    # a wheel carries the tables only if pyproject names them as package data
    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    rel = tiles.TABLE_DIR.relative_to(tiles.TABLE_DIR.parent)
    assert f'"elasticep.moe.experts" = ["{rel}/*.json"]' in text
    # every shipped table parses, is named for its device, and has entries
    shipped = sorted(tiles.TABLE_DIR.glob("*.json"))
    assert shipped, "no measured table is shipped"
    for path in shipped:
        device = json.loads(path.read_text())["device"]
        assert path == tiles.table_path(device), path
        assert tiles.load_table(path), path


def test_the_sweep_ships_a_tile_only_past_the_noise():
    from bench.fp8_decode_sweep import choose

    def rec(us, default=False, ok=True):
        return {"us": us, "default": default, "ok": ok}

    base, staged, other = DEFAULTS["fp8_rows_down"], Tile(32, 4, num_stages=2), Tile(64, 8)
    assert choose([(base, rec(10.0, True)), (other, rec(9.8))], 0.03) == (base, rec(10.0, True))
    assert choose([(base, rec(10.0, True)), (other, rec(9.0))], 0.03) == (other, rec(9.0))
    assert choose([(base, rec(10.0, True)), (other, rec(9.0)), (staged, rec(8.9))],
                  0.03) == (other, rec(9.0))
    assert choose([(base, rec(10.0, True)), (staged, rec(8.0))], 0.03) == (staged, rec(8.0))
    assert choose([(base, rec(1.0, True, ok=False))], 0.03) is None


def _interpreted() -> dict:
    """Under TRITON_INTERPRET=1: the kernels with non-default tiles read from a table
    against the reference, then the sweep's dry run and the table it wrote."""
    from test_fp8_rows import packed_case

    from bench import fp8_decode_sweep
    from elasticep.moe.experts.fp8_rows import swiglu_rows_fp8, swiglu_rows_fp8_reference
    from elasticep.moe.experts.fp8_sorted import swiglu_sorted_fp8
    from elasticep_testkit.fp8_expert_check import rounding_bound, worst_ratio

    out = {}
    with tempfile.TemporaryDirectory() as d:
        _write(Path(d), [_entry(hidden=160, inter=128, bucket=64, block=4, num_warps=2),
                         _entry("fp8_rows_down", 160, 128, 64, block=64, num_warps=8),
                         _entry("fp8_sorted_gate_up", 160, 128, 8, block=32, block_m=32),
                         _entry("fp8_sorted_down", 160, 128, 8, block=16, block_m=16)])
        case = packed_case(4, 160, 128, 20, torch.float32, seed=3)
        bound = rounding_bound(*case)
        ref = swiglu_rows_fp8_reference(*case)
        for name, fn, kernels, slots_for_bucket in (
                ("rows", swiglu_rows_fp8, ("fp8_rows_gate_up", "fp8_rows_down"), 1),
                ("sorted", swiglu_sorted_fp8, ("fp8_sorted_gate_up", "fp8_sorted_down"), 4)):
            picked = tuple(decode_tile(k, 160, 128, tiles.bucket_value(k, 20, slots_for_bucket),
                                       DEVICE, Path(d)) for k in kernels)
            out[name + "_tiles"] = [repr(t) for t in picked]
            out[name] = worst_ratio(fn(*case, tiles=picked), ref, bound)
    with tempfile.TemporaryDirectory() as d:
        table = Path(d) / "table.json"
        log = io.StringIO()
        with contextlib.redirect_stdout(log):
            rc = fp8_decode_sweep.main(
                ["--device", "cpu", "--grid", "tiny", "--shape", "256x128:4", "--rows", "2",
                 "--sorted-rows", "8", "--stages", "1", "--min-gain", "0",
                 "--write-table", str(table), "--write-table", f"{d}/tiles"])
        out["sweep_rc"] = rc
        out["sweep_lines"] = [json.loads(line) for line in log.getvalue().splitlines()]
        out["table"] = table.read_text()
        out["table_in_dir"] = (Path(d) / "tiles" / "cpu.json").read_text()
    return out


def test_kernels_and_sweep_interpreted():
    res = run_interpreted(__file__, timeout_s=180)
    # the tiles the table gives, not the defaults
    assert res["rows_tiles"] == [repr(Tile(4, 2)), repr(Tile(64, 8))]
    assert res["sorted_tiles"] == [repr(Tile(32, 2, 32)), repr(Tile(16, 2, 16))]
    assert res["rows"] <= 1 and res["sorted"] <= 1, res  # within the rounding bound
    assert res["sweep_rc"] == 0
    lines = res["sweep_lines"]
    configs = [r for r in lines if r["bench"] == "fp8_decode_sweep"]
    summary = lines[-1]
    assert summary["bench"] == "fp8_decode_sweep_summary"
    # per kernel: the default, one other tile, and the fastest at num_stages 1
    assert len(configs) == summary["configs"] == 12 and summary["failed"] == 0
    assert all(r["ok"] and r["worst_over_bound"] <= 1 and r["bound_us"] > 0 for r in configs)
    # the written table holds each kernel's fastest config, and the lookup reads it back
    assert res["table_in_dir"] == res["table"]  # a directory (made) gets <device slug>.json
    entries = parse_table(res["table"], "sweep table")
    assert len(entries) == 4
    for e in entries:
        timed = [r for r in configs if r["kernel"] == e.kernel]
        fastest = min(timed, key=lambda r: r["us"])
        assert e.tile == Tile(fastest["block"], fastest["num_warps"], fastest["block_m"],
                              fastest["num_stages"])
        assert tiles.select(entries, e.kernel, 256, 128, fastest["bucket"]) == e.tile



def test_the_prefill_sweep_refuses_a_table_it_cannot_merge_into_before_it_runs(
        tmp_path, monkeypatch, capsys):
    """write_merged refused a malformed --write-table file with a traceback, and only
    after the sweep's minutes on the GPU; the check comes first (on CPU too)."""
    import sys

    from bench.fp8_expert_prefill import main

    bad = _write(tmp_path, [_entry(kernel="w8a8_gate_up", block=64)])
    monkeypatch.setattr(sys, "argv", ["fp8_expert_prefill", "--sweep", "--write-table",
                                      str(bad)])
    assert main() == 2
    assert capsys.readouterr().err.splitlines() == [
        f"bench.fp8_expert_prefill: error: --write-table: {bad} entry 0: w8a8_gate_up's "
        "block is one scale group, 128, got 64"]


if __name__ == "__main__":
    print(json.dumps(_interpreted()))
