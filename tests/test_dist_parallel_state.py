"""parallel_state contract for EP4 plus a scale cohort of 2 at offset 4 (no processes).

torch.distributed.new_group is replaced by a recorder, so the test sees exactly which
groups each rank builds, with which options and synchronization mode.
"""

import pytest
import torch.distributed as dist

from elasticep.compat import parallel_state as ps


@pytest.fixture
def record(monkeypatch):
    calls = []

    def fake_new_group(ranks, **kw):
        calls.append((list(ranks), kw))
        return object()

    def as_rank(r):
        monkeypatch.setattr(dist, "get_rank", lambda group=None: r)
        ps.destroy_model_parallel()
        calls.clear()
        return calls

    monkeypatch.setattr(dist, "new_group", fake_new_group)
    yield as_rank
    ps.destroy_model_parallel()


def _build(rank_offset, recovered=False):
    world = ps.init_world_group(list(range(4)), 0, "elastic", recovered_rank=recovered,
                                max_world_size=6)
    ps.initialize_model_parallel(2 if rank_offset else 4, 2 if rank_offset else 4,
                                 recovered_rank=recovered, rank_offset=rank_offset,
                                 max_world_size=6)
    return world


@pytest.mark.timeout(20)
def test_original_cohort_builds_every_group_globally(record):
    calls = record(1)
    world = _build(0)
    assert world.ranks == [0, 1, 2, 3, 4, 5] and world.max_group_size == 6
    assert calls[0][0] == [0, 1, 2, 3, 4, 5]
    assert not world.is_extension and not world.use_local_synchronization
    assert calls[0][1]["pg_options"].max_group_size == 6
    assert calls[0][1]["pg_options"].active_ranks.tolist() == [1, 1, 1, 1, 0, 0]
    # every model-parallel group (TP, EP, then each rank's PP and DP), built by every
    # rank of the cohort: fixed ranks, no capacity, global synchronization
    assert [r for r, _ in calls[1:]] == [[0, 1, 2, 3]] * 2 + [[0], [1], [2], [3]] * 2
    for _ranks, kw in calls[1:]:
        assert kw["pg_options"].max_group_size is None
        assert kw["use_local_synchronization"] is False
        assert not kw["pg_options"].is_extension
    assert ps.get_tp_group().ranks == [0, 1, 2, 3]
    assert ps.get_moe_ep_group().ranks == [0, 1, 2, 3]
    assert ps._PP.ranks == [1]
    assert ps.get_tp_group().rank_in_group == 1
    names = [g.unique_name for g in ps.iter_live_parallel_groups()]
    assert names == sorted(names) and len(names) == 5


@pytest.mark.timeout(20)
def test_scale_cohort_at_offset_4_uses_local_synchronization(record):
    calls = record(5)
    world = _build(4)
    assert world.ranks == [0, 1, 2, 3, 4, 5] and world.is_extension  # joins WORLD capacity
    assert world.rank_in_group == 5
    assert calls[0][1]["use_local_synchronization"] is False
    mp_calls = calls[1:]
    assert all(kw["use_local_synchronization"] is True for _, kw in mp_calls)
    assert all(kw["pg_options"].max_group_size is None for _, kw in mp_calls)
    assert all(not kw["pg_options"].is_extension for _, kw in mp_calls)
    assert ps.get_tp_group().ranks == [4, 5]
    assert ps.get_moe_ep_group().ranks == [4, 5]
    assert ps._PP.ranks == [5]
    # local synchronization: it builds only the groups it is a member of
    assert all(5 in ranks for ranks, _ in mp_calls)
    assert sorted(map(tuple, (r for r, _ in mp_calls))) == [(4, 5), (4, 5), (5,), (5,)]


@pytest.mark.timeout(20)
def test_recovered_rank_rebuilds_globally_as_extension(record):
    calls = record(2)
    _build(0, recovered=True)
    # the same eleven groups as the original cohort (an empty list would pass the alls)
    assert [r for r, _ in calls] == [list(range(6))] + [[0, 1, 2, 3]] * 2 + [[0], [1], [2], [3]] * 2
    assert all(kw["pg_options"].is_extension for _, kw in calls)
    assert all(kw["use_local_synchronization"] is False for _, kw in calls)


@pytest.mark.timeout(20)
def test_pp_must_be_one_when_elastic(record):
    record(0)
    with pytest.raises(ValueError):
        ps.initialize_model_parallel(2, 2, pipeline_model_parallel_size=2)
