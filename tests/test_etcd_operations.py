"""Scale and retire operations survive a coordinator restart through a real 3-member
etcd on 127.0.0.1: the first coordinator's state reaches etcd through its persister, and
a coordinator started on the same prefix (the server's own restore path, over its
socket) answers the old operation ids, repeats them idempotently, and goes on with the
target, limits and id counter where the first left them."""

from __future__ import annotations

import uuid

import pytest
from test_retire_ranks import SUP, _deployment, _ok, _remove_voted

from elasticep.membership import CoordinatorClient, start_coordinator
from elasticep.membership.errors import OperationConflictError, ScaleRefusedError
from elasticep.membership.etcd_store import EtcdMembershipStore
from elasticep.membership.messages import Retire, Scale
from elasticep.membership.persister import StatePersister
from elasticep.membership.store import parse_store_url
from elasticep_testkit.etcd_cluster import EtcdCluster

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def cluster():
    with EtcdCluster.start(3) as c:
        yield c


def test_an_operation_id_survives_a_coordinator_restart(cluster):
    url = f"{cluster.url}/t-{uuid.uuid4().hex[:8]}"
    # the first coordinator: rank 1 of EP4 retired under an id, then an id it made up
    svc = _deployment(4, {r: 0 for r in range(4)}, min_holding=2)
    retire = _ok(svc, SUP, Retire(ranks=[1], operation_id="maint-7", id=10))
    _remove_voted(svc, [1])
    assert _ok(svc, SUP, Scale(3, id=11))["operation_id"] == "op-1"
    persister = StatePersister(EtcdMembershipStore(parse_store_url(url)), svc.durable_state, 0)
    try:
        assert persister.wait_committed(10)
    finally:
        persister.close()

    second = start_coordinator(membership_store=EtcdMembershipStore(parse_store_url(url)))
    client = CoordinatorClient(second.address)
    try:
        # no rank has reconnected: the retired slot's process is not known any more
        assert client.operation("maint-7") == {
            "operation_id": "maint-7", "request": {"retire_ranks": [1]}, "phase": "done",
            "ranks": [{"rank": 1, "state": "safe_to_terminate"}]}
        assert client.operation("op-1")["request"] == {"new_ep_size": 3}
        assert client.retire([1], operation_id="maint-7") == {**retire, "repeated": True}
        with pytest.raises(OperationConflictError, match="use a new operation_id"):
            client.retire([2], operation_id="maint-7")
        # the target (rank 1 retired), the limits and the id counter carried over
        status = client.deployment_status()
        assert status.ep_size == 3 and status.rank(1).state == "free"
        with pytest.raises(ScaleRefusedError, match="at least 2"):
            client.retire([0, 2])
        assert client.scale(3)["operation_id"] == "op-2"
        assert client.reserve([1], "recover") == 4  # a retired slot comes back in place
    finally:
        client.close()
        second.close()
