"""bench/_deploy.py's ``survivor_recaptures``: CUDA graph re-captures counted on the
ranks that lived through a failover run, told apart by pid."""

from __future__ import annotations

from bench._deploy import survivor_recaptures


def test_only_ranks_with_the_same_process_throughout_count():
    # rank 0 survives and re-captured twice; rank 1 is the victim (relaunched, its new
    # process captured 8); rank 2 is no victim but died and came back: its gauge reads
    # lower; rank 3 is no victim and died for good (its gauge keeps its last value);
    # rank 4 joined during the run
    before = {0: 10.0, 1: 10.0, 2: 10.0, 3: 10.0}
    after = {0: 12.0, 1: 8.0, 2: 10.0, 3: 15.0, 4: 8.0}
    pids_before = {0: 100, 1: 101, 2: 102, 3: 103}
    pids_after = {0: 100, 1: 201, 2: 202, 4: 204}
    out = survivor_recaptures(before, after, pids_before, pids_after, victims=[1])
    assert out == {"survivor_recaptures": 2, "survivor_ranks": [0],
                   "relaunched_non_victims": [2]}


def test_no_recapture_is_zero_and_no_report_is_none():
    same = {0: 4.0, 1: 4.0}
    pids = {0: 10, 1: 11}
    assert survivor_recaptures(same, same, pids, pids, []) == {
        "survivor_recaptures": 0, "survivor_ranks": [0, 1], "relaunched_non_victims": []}
    assert survivor_recaptures({}, {}, pids, pids, [])["survivor_recaptures"] is None
