"""send/recv are asynchronous: a ring where every rank sends first completes, transfers
keep their order, and a dead peer fails only the transfers with it."""

import pytest
import torch
from _dist_harness import coordinated_cluster

from elasticep.distributed.epoch_log import EpochLog
from elasticep.distributed.p2p import PeerChannels, PeerGroup
from elasticep.membership.errors import RankFailureError
from elasticep.membership.transitions import SlotState


@pytest.mark.timeout(60)
def test_ring_order_and_dead_peer():
    with coordinated_cluster() as (_, cl):
        for r in range(3):
            cl.start(r, "p2p_async", 3)
        cl.wait_for(lambda m: sum(x[1] == "dead" for x in m) == 2, 50, "dead-peer round")
        assert [cl.of(r, "ring")[0] for r in range(3)] == [20, 0, 10]
        sent, got = cl.of(0, "ordered")[0], cl.of(1, "ordered")[0]
        assert got == sent == [[i + 0.5] * 3 for i in range(4)]
        for r in (0, 1):
            dead, got = cl.of(r, "dead")[0]
            assert dead == [[2], [2]]
            assert got == (1 - r) + 7.0


class _Store:
    """A store whose peers never publish: every wait times out at once."""

    def __init__(self):
        self.keys = {}

    def set(self, key, value):
        self.keys[key] = value

    def wait(self, keys, timeout):
        raise TimeoutError(f"no {keys}")


def _group(states):
    store = _Store()
    return store, PeerGroup("g", 0, 3, 5.0, "127.0.0.1", store, lambda: store,
                            EpochLog(0, (0, 1, 2)), lambda what: None, lambda: None,
                            lambda s: states[s])


@pytest.mark.timeout(30)
def test_channels_see_the_group_only_through_peer_group():
    """No sockets: the channels' checks come from `PeerGroup`'s facts and callbacks."""
    states = [SlotState.HEALTHY] * 3
    store, group = _group(states)
    peers = PeerChannels(group)
    try:
        assert store.keys == {"elastic/g/p2p-token/0": peers.token}
        for bad in (0, 3, -1):  # itself, past the size, negative
            with pytest.raises(ValueError, match="not another slot"):
                peers.post("send", torch.ones(2), bad, 0)
        work = peers.post("recv", torch.ones(2), 2, 0)
        states[2] = SlotState.FAILED  # its slot fails: the wait raises, naming it
        with pytest.raises(RankFailureError) as err:
            work.wait()
        assert err.value.dead_ranks == [2]
        # a later epoch without slot 1 makes its channel stale: the next post rebuilds it
        first = peers.post("send", torch.ones(2), 1, 0).channel
        group.epochs.add(5, 1, (0, 2))
        assert first.stale()
        assert peers.post("send", torch.ones(2), 1, 0).channel is not first
    finally:
        peers.close()
