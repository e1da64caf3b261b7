"""The membership store and leader election against a real 3-member etcd cluster on
127.0.0.1 (Debian's etcd-server, installed by `make install`): fencing of a deposed
leader, the refusal of a second deployment on one prefix, a new leader within TTL + 1 s
of a SIGKILLed one, a member loss that changes nothing, and a quorum loss that
commits nothing until quorum returns."""

import os
import signal
import subprocess
import time
import uuid

import pytest

from elasticep.membership.directory import FRONTENDS, REPLICAS, Announcement, list_entries
from elasticep.membership.durable_state import MembershipState
from elasticep.membership.election import LeaderLease
from elasticep.membership.errors import (
    FencedCommitError,
    PrefixInUseError,
    StoreUnavailableError,
)
from elasticep.membership.etcd_store import EtcdKV, EtcdMembershipStore, b64
from elasticep.membership.store import parse_store_url
from elasticep.membership.transitions import SlotState
from elasticep_testkit.etcd_cluster import EtcdCluster, spawn_leader
from elasticep_testkit.harness.serve_process import cli_command, free_port

pytestmark = pytest.mark.timeout(60)

TTL_S = 1


@pytest.fixture(scope="module")
def cluster():
    with EtcdCluster.start(3) as c:
        yield c


def _store(cluster, prefix: str) -> EtcdMembershipStore:
    return EtcdMembershipStore(parse_store_url(f"{cluster.url}/{prefix}"))


def _prefix() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


def test_state_commits_and_reloads_through_etcd(cluster):
    store = _store(cluster, _prefix())
    assert store.load() == (None, 0)
    s1 = MembershipState(max_world_size=4, config='{"m": 1}')
    rev1 = store.commit(s1, 0)
    assert rev1 > 0
    other = _store(cluster, store.spec.prefix)  # another replica reads what was committed
    assert other.load() == (s1, rev1)
    s2 = MembershipState(max_world_size=4, config='{"m": 2}')
    rev2 = other.commit(s2, rev1)
    assert rev2 > rev1 and store.load() == (s2, rev2)


def test_a_deposed_leader_cannot_commit(cluster):
    prefix = _prefix()
    a, b = _store(cluster, prefix), _store(cluster, prefix)
    lease_a = LeaderLease(a, "node-a", TTL_S)
    assert lease_a.try_acquire() and lease_a.is_leader
    _, rev = a.load()
    rev = a.commit(MembershipState(max_world_size=2), rev)

    # a is cut off: its lease is gone (revoked here, as an expiry would), b is elected
    # and commits; a still holds the revision it last read
    b.kv.post("kv/lease/revoke", {"ID": lease_a._lease})
    lease_b = LeaderLease(b, "node-b", TTL_S)
    assert lease_b.try_acquire() and lease_b.leader() == "node-b"
    _, rev_b = b.load()
    assert rev_b == rev
    b.commit(MembershipState(max_world_size=3), rev_b)
    with pytest.raises(FencedCommitError, match="deposed"):
        a.commit(MembershipState(max_world_size=9), rev)
    assert b.load()[0].max_world_size == 3
    # a learns it lost the lease at its next keep-alive (within TTL / 3 + a request)
    deadline = time.monotonic() + TTL_S + 1
    while lease_a.is_leader and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not lease_a.is_leader
    lease_a.resign()  # its lease is gone already: nothing to revoke, no error
    lease_b.resign()


def test_a_deposed_leader_cannot_commit_even_before_its_successor_has(cluster):
    """With ``leader_id`` the commit also needs the lease: the deposed leader's commit
    on an unchanged revision fails, and the successor's goes through."""
    prefix = _prefix()
    a = EtcdMembershipStore(parse_store_url(f"{cluster.url}/{prefix}"), leader_id="node-a")
    b = EtcdMembershipStore(parse_store_url(f"{cluster.url}/{prefix}"), leader_id="node-b")
    lease_a = LeaderLease(a, "node-a", TTL_S)
    assert lease_a.try_acquire()
    rev = a.commit(MembershipState(max_world_size=2), 0)
    b.kv.post("kv/lease/revoke", {"ID": lease_a._lease})
    lease_b = LeaderLease(b, "node-b", TTL_S)
    assert lease_b.try_acquire()
    with pytest.raises(FencedCommitError, match="node-a no longer leads"):
        a.commit(MembershipState(max_world_size=9), rev)  # nobody committed since rev
    b.commit(MembershipState(max_world_size=3), rev)
    assert b.load()[0].max_world_size == 3
    lease_a.resign()
    lease_b.resign()


def test_a_leader_whose_lease_expired_campaigns_again(cluster):
    """Its lease gone in etcd (revoked here, as an expiry during an outage would): with
    ``recampaign`` it notices at its next keep-alive and takes the free key back."""
    store = _store(cluster, _prefix())
    lost = []
    lease = LeaderLease(store, "coord", TTL_S, on_lost=lambda: lost.append(1),
                        recampaign=True)
    assert lease.try_acquire()
    first = lease._lease
    store.kv.post("kv/lease/revoke", {"ID": first})
    deadline = time.monotonic() + TTL_S + 1
    while not (lost and lease.is_leader) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lost == [1] and lease.is_leader and lease._lease != first
    assert lease.leader() == "coord"
    lease.resign()


def test_a_leader_that_finds_a_successor_after_its_loss_steps_down(cluster):
    """Its lease expired (revoked here) and another replica was elected meanwhile: the
    campaign after the loss finds the successor and calls ``on_deposed`` once, so a
    coordinator closes its ranks' connections instead of serving on deposed."""
    prefix = _prefix()
    deposed = []
    a = LeaderLease(_store(cluster, prefix), "node-a", TTL_S, recampaign=True,
                    on_deposed=deposed.append)
    assert a.try_acquire()
    b = LeaderLease(_store(cluster, prefix), "node-b", TTL_S)
    b.store.kv.post("kv/lease/revoke", {"ID": a._lease})
    assert b.try_acquire()
    deadline = time.monotonic() + TTL_S + 2
    while not deposed and time.monotonic() < deadline:
        time.sleep(0.05)
    assert deposed == ["node-b"] and not a.is_leader and b.leader() == "node-b"
    time.sleep(0.3)
    assert deposed == ["node-b"]  # once; it campaigns no more
    b.resign()


def test_an_announcement_is_listed_while_it_lives_and_comes_back_after_its_lease(cluster):
    """The front-end directory: an entry is listed once started, put again under a fresh
    lease when its lease is gone (etcd lost it), and gone as soon as it is closed."""
    store = _store(cluster, _prefix())
    entry = Announcement(store, FRONTENDS, "node1", {"url": "http://h:1", "node": 1}, TTL_S)
    entry.start()
    try:
        assert list_entries(store, FRONTENDS) == {"node1": {"url": "http://h:1", "node": 1}}
        assert list_entries(store, REPLICAS) == {}
        key = b64(store.key(FRONTENDS + "node1"))
        lease = store.kv.post("kv/range", {"key": key})["kvs"][0]["lease"]
        store.kv.post("kv/lease/revoke", {"ID": lease})  # as if it had expired
        assert list_entries(store, FRONTENDS) == {}
        deadline = time.monotonic() + 5 * TTL_S
        while not list_entries(store, FRONTENDS) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert list(list_entries(store, FRONTENDS)) == ["node1"]
    finally:
        entry.close()
    assert list_entries(store, FRONTENDS) == {}
    store.close()


def test_a_second_deployment_on_the_same_prefix_is_refused_while_the_first_runs(cluster):
    prefix = _prefix()
    first, replica, second = (_store(cluster, prefix) for _ in range(3))
    first.claim("dep-1")
    lease = LeaderLease(first, "coord-1", TTL_S)
    assert lease.try_acquire()
    first.commit(MembershipState(max_world_size=4), 0)
    replica.claim("dep-1")  # another node of the same deployment
    with pytest.raises(PrefixInUseError, match="held by deployment 'dep-1', whose "
                                               "coordinator is running"):
        second.claim("dep-2")
    _store(cluster, _prefix()).claim("dep-2")  # its own prefix is fine
    # dep-1 stops (its coordinator resigns): dep-2 takes the prefix over, from nothing
    lease.resign()
    second.claim("dep-2")
    assert second.load() == (None, 0)
    assert second.kv.get(second.key("owner"))[0] == b"dep-2"


def test_a_new_leader_within_ttl_plus_1s_of_a_sigkilled_one(cluster):
    prefix = _prefix()
    proc = spawn_leader(f"{cluster.url}/{prefix}", "killed", TTL_S)
    try:
        standby = LeaderLease(_store(cluster, prefix), "standby", TTL_S)
        assert not standby.try_acquire() and standby.leader() == "killed"
        os.kill(proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        standby.campaign(timeout_s=TTL_S + 5)
        took = time.monotonic() - killed_at
        assert standby.leader() == "standby"
        assert took <= TTL_S + 1, f"new leader {took:.2f} s after the kill"
        standby.resign()
        assert standby.leader() is None  # resigning frees the key at once
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def test_a_standby_takes_a_dead_leaders_lease_when_it_runs_out_not_at_etcds_sweep(cluster):
    """A 2 s lease (the watch needs 2 s or more), renewed once and then no more: the
    campaigning standby revokes it at its expiry, within two of its readings, rather than
    whenever etcd's half-second sweep comes (up to 2.5 s plus a poll); etcd then refuses
    the old owner's keep-alive, as it would after its own sweep."""
    prefix = _prefix()
    store = _store(cluster, prefix)
    lease = int(store.kv.post("lease/grant", {"TTL": 2, "ID": 0})["ID"])
    assert store.txn_create(store.key("leader"), "dead", lease)[0]
    standby = LeaderLease(_store(cluster, prefix), "standby", 2)
    sent = time.monotonic()
    store.kv.post("lease/keepalive", {"ID": lease})
    answered = time.monotonic()
    standby.campaign(timeout_s=5)
    took = time.monotonic()
    assert standby.leader() == "standby"
    assert sent + 2.0 <= took <= answered + 2.35, (took - sent, answered - sent)
    out = store.kv.post("lease/keepalive", {"ID": lease})
    assert int(out.get("result", {}).get("TTL", -1)) <= 0
    standby.resign()


def test_etcd_unreachable_is_one_clear_error():
    kv = EtcdKV([("127.0.0.1", free_port()), ("127.0.0.1", free_port())])
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailableError, match="no etcd member answered") as e:
        kv.status()
    assert time.monotonic() - t0 < 5 and "\n" not in str(e.value)


def test_a_port_that_answers_but_is_not_etcd_is_one_clear_error():
    """A client URL that reaches some other HTTP server (a wrong port) ended serve with
    requests' JSONDecodeError traceback (exit 1); it counts as a member that did not
    answer, so the call moves on to the next."""
    import http.server
    import threading

    class _NotEtcd(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Length", "5")
            self.end_headers()
            self.wfile.write(b"hello")

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), _NotEtcd)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        kv = EtcdKV([("127.0.0.1", port)])
        with pytest.raises(StoreUnavailableError) as e:
            kv.status()
        assert str(e.value) == (f"no etcd member answered (127.0.0.1:{port}: not an etcd "
                                "gateway: its answer is not a JSON object)")
    finally:
        server.shutdown()
        server.server_close()


def test_a_call_tries_every_member_once_while_another_thread_moves_the_start():
    """A lease keep-alive thread shares the EtcdKV: one of its answers moving the start
    member mid-call must not send the call back to a member it already tried (it once
    retried the dead member and never asked the live one)."""
    import etcd3gw.exceptions as etcd_errors

    kv = EtcdKV([("127.0.0.1", free_port()) for _ in range(3)])
    tried = []

    class _Member:
        def __init__(self, i, outcome):
            self.host, self.port, self.i, self.outcome = "127.0.0.1", 1000 + i, i, outcome

        def get_url(self, path):
            return path

        def post(self, url, json):
            tried.append(self.i)
            if self.i == 1:
                kv._current = 1  # the keep-alive thread's answer came from member 1
            if self.outcome is None:
                return {"member": self.i}
            raise self.outcome

    kv._clients = [_Member(0, etcd_errors.ConnectionFailedError()),
                   _Member(1, etcd_errors.ConnectionTimeoutError()), _Member(2, None)]
    assert kv.post("kv/range", {}) == {"member": 2}
    assert tried == [0, 1, 2]


def test_one_member_down_changes_nothing_and_quorum_loss_commits_nothing(cluster):
    store = _store(cluster, _prefix())
    lease = LeaderLease(store, "leader", TTL_S)
    assert lease.try_acquire()
    rev = store.commit(MembershipState(max_world_size=1), 0)
    try:
        cluster.kill(0)  # the member the store's client talks to first
        rev = store.commit(MembershipState(max_world_size=2), rev)
        time.sleep(TTL_S + 0.5)  # keep-alives go on through the other members
        assert lease.is_leader
        cluster.kill(1)  # 1 of 3 left: no quorum
        with pytest.raises(StoreUnavailableError):
            store.commit(MembershipState(max_world_size=3), rev)
        deadline = time.monotonic() + TTL_S + 4
        while lease.is_leader and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not lease.is_leader  # it stops counting itself a leader on its own clock
    finally:
        lease.resign()
        cluster.restart(0)
        cluster.restart(1)
    cluster.wait_writable(20)
    # the refused commit's outcome was unknown (the lone member may have logged it and
    # committed it once its peers came back); the reloaded state says which, and a
    # commit naming the reloaded revision goes through
    state, now = store.load()
    assert (state, now) == (MembershipState(max_world_size=2), rev) or (
        state == MembershipState(max_world_size=3) and now > rev)
    try:
        store.commit(MembershipState(max_world_size=4), now)
    except FencedCommitError:
        # the logged proposal was applied after that read (seen once in a full run):
        # then the store holds it, and a commit naming its revision goes through
        state, now = store.load()
        assert state == MembershipState(max_world_size=3) and now > rev
        store.commit(MembershipState(max_world_size=4), now)
    assert store.load()[0] == MembershipState(max_world_size=4)


def test_the_coordinator_commits_each_change_and_a_successor_takes_over(cluster):
    """A coordinator with an etcd store commits what it is told; a second one on the
    same prefix takes that state over, and the first, deposed, can commit no more."""
    from elasticep.membership import CoordinatorClient, start_coordinator

    prefix = _prefix()
    first = start_coordinator(membership_store=_store(cluster, prefix))
    second = None
    try:
        client = CoordinatorClient(first.address)
        client.publish_deployment('{"model": "a"}', 2, 4)
        client.close()
        assert first.wait_committed(5)
        state, rev = _store(cluster, prefix).load()
        assert state.config == '{"model": "a"}' and state.target["ep_size"] == 2
        assert first.store_health().ok and first.store_health().revision == rev

        second = start_coordinator(membership_store=_store(cluster, prefix))
        client = CoordinatorClient(second.address)
        assert client.deployment_config() == '{"model": "a"}'  # taken over
        client.publish_deployment('{"model": "b"}', 2, 4)
        client.close()
        assert second.wait_committed(5)
        assert _store(cluster, prefix).load()[0].config == '{"model": "b"}'

        client = CoordinatorClient(first.address)  # the deposed one changes something
        client.publish_deployment('{"model": "c"}', 2, 4)
        client.close()
        first.wait_committed(5)
        health = first.store_health()
        assert health.deposed and not health.ok and "deposed" in health.reason
        assert _store(cluster, prefix).load()[0].config == '{"model": "b"}'
    finally:
        first.close()
        if second is not None:
            second.close()


def test_join_with_no_coordinator_elected_says_so(cluster):
    prefix = _prefix()
    join = subprocess.run(cli_command("join", "--membership-store", f"{cluster.url}/{prefix}",
                                      "--elastic-ep-join-mode", "recover", "--ranks", "0",
                                      "--coordinator-timeout", "0.5"),
                          capture_output=True, text=True, timeout=60)
    assert join.returncode == 1, join.stderr[-3000:]
    assert join.stderr.strip().splitlines()[-1] == (
        f"elasticep join: error: --membership-store: no coordinator leads under "
        f"/elasticep/{prefix}/ (waited 0.5 s): is serve running with this "
        "--membership-store?"), join.stderr[-3000:]


def test_join_needs_an_address_or_a_store():
    join = subprocess.run(cli_command("join", "--elastic-ep-join-mode", "recover", "--ranks",
                                      "0"), capture_output=True, text=True, timeout=60)
    assert join.returncode == 2
    assert join.stderr.strip().splitlines()[-1] == (
        "elasticep join: error: give --dist-init-addr HOST:PORT (printed by serve) or "
        "--membership-store etcd://..."), join.stderr[-3000:]


def _serve(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(cli_command("serve", "--ep-size", "2", "--port", "0",
                                      "--dist-init-addr", "127.0.0.1:0", *flags),
                          capture_output=True, text=True, timeout=40)


def test_serve_with_etcd_unreachable_exits_2_in_one_line():
    url = f"etcd://127.0.0.1:{free_port()}"
    serve = _serve("--membership-store", url)
    assert serve.returncode == 2, serve.stderr[-3000:]
    errors = [line for line in serve.stderr.splitlines() if "error" in line.lower()]
    assert errors == [f"elasticep serve: error: --membership-store: no etcd member answered "
                      f"({url[7:]}: ConnectionFailedError)"], serve.stderr[-3000:]


def test_serve_on_a_prefix_another_deployment_holds_exits_2(cluster):
    prefix = _prefix()
    other = _store(cluster, prefix)
    other.claim("the-other-deployment")
    lease = LeaderLease(other, "its-coordinator", TTL_S)
    assert lease.try_acquire()  # it runs
    try:
        serve = _serve("--membership-store", f"{cluster.url}/{prefix}")
    finally:
        lease.resign()
    assert serve.returncode == 2, serve.stderr[-3000:]
    assert serve.stderr.strip().splitlines()[-1] == (
        f"elasticep serve: error: --membership-store: etcd prefix /elasticep/{prefix}/ is "
        "held by deployment 'the-other-deployment', whose coordinator is running; give this "
        "deployment another prefix (etcd://HOST:PORT/PREFIX)"), serve.stderr[-3000:]



def test_serve_keeps_its_membership_in_etcd_and_serves_through_a_quorum_loss(cluster):
    """serve --membership-store etcd://: ready as usual, its status names the store and
    the leader, the published deployment is in etcd; with 2 of 3 members down it still
    answers, /health says why it is degraded, and it is whole again once they are back."""
    import httpx

    from tests._serve_fixtures import start_serve

    prefix = _prefix()
    with start_serve("--ep-size", "2", "--membership-store", f"{cluster.url}/{prefix}") as s:
        store = s.status().membership_store
        assert store is not None and store.kind == "etcd" and store.ok, store
        assert store.leader == s.coordinator and store.revision > 0  # its control address
        state, _ = _store(cluster, prefix).load()
        assert state.target["ep_size"] == 2 and '"ep_size":2' in state.config
        assert state.groups["world"]["active"] == [0, 1]

        def complete() -> str:
            out = s.client.completions.create(model=s.model_name(), prompt="1 + 1 =",
                                              max_tokens=4, temperature=0)
            return out.choices[0].text

        # `join` finds the coordinator through etcd: it reaches it and is refused there
        # (slot 0 is healthy, nothing to recover)
        join = subprocess.run(cli_command("join", "--membership-store",
                                          f"{cluster.url}/{prefix}",
                                          "--elastic-ep-join-mode", "recover", "--ranks", "0"),
                              capture_output=True, text=True, timeout=60)
        assert join.returncode == 2, join.stderr[-3000:]
        assert f"coordinator {s.coordinator} found through etcd" in join.stderr
        assert join.stderr.strip().splitlines()[-1].startswith(
            "elasticep join: error: rank 0 "), join.stderr[-3000:]
        _, rev = _store(cluster, prefix).load()
        before = complete()
        assert complete() == before
        # steady serving writes nothing to etcd: only membership changes are committed
        assert _store(cluster, prefix).load()[1] == rev
        health = httpx.get(f"{s.url}/health", timeout=10).json()
        assert "membership_store" not in health and not health["degraded"], health
        metrics = httpx.get(f"{s.url}/metrics", timeout=10).text
        assert 'elasticep_membership_store_ok{store="etcd"} 1.0' in metrics
        assert f'elasticep_coordinator_leader{{replica="{store.leader}"}} 1.0' in metrics
        epoch0 = s.status().epoch
        cluster.kill(0)
        cluster.kill(1)
        try:
            # past the lease TTL without etcd, it stops counting itself the leader
            s.wait_for(lambda st: st.membership_store.leader is None, 10,
                       "the leader to give up its lease on its own clock")
            # a change asked for while etcd has no quorum: accepted, but it does not
            # begin (its commit could not be stored, and an announced epoch would hold
            # every rank at the boundary): serving goes on, the store says why
            code, body = s.scale(1)
            assert code == 200, body
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                health = httpx.get(f"{s.url}/health", timeout=10).json()
                if "membership_store" in health:
                    break
                time.sleep(0.2)
            assert health["membership_store"].startswith(
                "membership store unavailable: no etcd member answered"), health
            assert health["status"] == "ok" and health["degraded"]
            metrics = httpx.get(f"{s.url}/metrics", timeout=10).text
            assert 'elasticep_membership_store_ok{store="etcd"} 0.0' in metrics
            assert complete() == before  # both ranks still serve
            st = s.status()  # rank 1 drains (the scale's intent), but no epoch commits
            assert st.epoch == epoch0 and st.state_of(1) == SlotState.DRAINING, st
        finally:
            cluster.restart(0)
            cluster.restart(1)
        s.wait_for(lambda st: st.membership_store.ok, 20, "the store to catch up")
        s.wait_for(lambda st: st.membership_store.leader == s.coordinator, 10,
                   "the coordinator to lead again")
        # then the change begins, and its epoch commits once etcd has it
        s.wait_for(lambda st: st.healthy_ranks() == [0] and st.epoch > epoch0, 30,
                   "the scale-down")
        # the commit reached the ranks once a snapshot holding its epoch was stored; the
        # group's active set there follows with the next snapshot, a tick later
        deadline = time.monotonic() + 10
        while True:
            state = _store(cluster, prefix).load()[0]
            if state.groups["world"]["active"] == [0] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert state.target["ep_size"] == 1 and state.groups["world"]["active"] == [0]
        assert complete() == before


def test_another_node_finds_the_coordinator_through_etcd_or_says_why(cluster):
    """Node 1 without --dist-init-addr looks the coordinator up in etcd: with no
    coordinator elected under the prefix it exits 1 naming the prefix."""
    prefix = _prefix()
    node1 = subprocess.run(cli_command("serve", "--ep-size", "2", "--nnodes", "2",
                                       "--node-rank", "1", "--coordinator-timeout", "0.5",
                                       "--membership-store", f"{cluster.url}/{prefix}"),
                           capture_output=True, text=True, timeout=60)
    assert node1.returncode == 1, node1.stderr[-3000:]
    assert node1.stderr.strip().splitlines()[-1] == (
        f"elasticep serve: error: no coordinator leads under /elasticep/{prefix}/ (waited "
        "0.5 s): is serve running with this --membership-store?"), node1.stderr[-3000:]


def test_a_cluster_gets_distinct_ports():
    # probed one at a time, two members once got one client port: the cluster started a
    # member short, and one member down then lost the quorum
    from elasticep_testkit.etcd_cluster import distinct_free_ports
    assert len(set(distinct_free_ports(64))) == 64
