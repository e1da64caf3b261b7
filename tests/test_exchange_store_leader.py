"""The same-host exchange's rendezvous store follows the coordinator leader
(``--membership-store etcd://``): after a leader change a rank puts its published
buffer handle in the new leader's store, and a rank that starts then rendezvouses
there, not at the first leader's store that the deployment's config names. A real
3-member etcd and two real coordinators; the rank is a process of its own. No CUDA:
the rank's buffers live on the CPU and their handle is a stand-in (the store part is
what is tested)."""

import os
import signal
import subprocess
import sys
import textwrap
from datetime import timedelta

import pytest
import torch.distributed as dist

from elasticep.distributed.leader_store import LeaderStore
from elasticep.elastic.exchange_setup import STORE_PREFIX
from elasticep.membership.process import CoordinatorProcess
from elasticep.moe.exchange.ipc_buffers import GEN_KEY, HANDLE_KEY
from elasticep.utils.wait import wait_until
from elasticep_testkit.etcd_cluster import EtcdCluster

# alone (make test's serial part): beside another file on the 2 CI cores the rank once
# did not reach the new leader within 20 s (passes alone; not explained)
pytestmark = [pytest.mark.timeout(60), pytest.mark.serial]

RANK = textwrap.dedent("""
    import sys, time
    import torch
    import elasticep.distributed as ed
    from elasticep.config import DeploymentConfig
    from elasticep.elastic.exchange_setup import exchange_store
    from elasticep.moe.exchange.ipc_buffers import GEN_KEY, IpcBuffers
    from elasticep.utils import cuda_ipc

    cuda_ipc.share = lambda t: b"arena-of-rank-0"  # no CUDA here: a stand-in handle
    first, url, first_store = sys.argv[1:4]
    ed.init_process_group(first, 0, 1, membership_store=url, stall_grace_s=20.0)
    d = DeploymentConfig(model="m", membership_store=url, store_addr=first_store)
    store = exchange_store(d, 10.0)
    buffers = IpcBuffers(0, 2, 16, 8, torch.float32, 2, "cpu")
    if isinstance(store, ed.LeaderStore):  # as the worker does
        store.republish.append(buffers.republish)
    print("published", buffers.publish(store), flush=True)
    sys.stdin.readline()  # the leader was replaced
    deadline = time.monotonic() + 20
    while ed.api.control_address() in (first, None) and time.monotonic() < deadline:
        time.sleep(0.02)
    print("resumed with", ed.api.control_address(), flush=True)
    print("generation", store.add(GEN_KEY.format(rank=0), 0), flush=True)
    joiner = exchange_store(d, 10.0)  # a rank starting now, with the same config
    joiner.set("joiner", b"here")
    print("done", flush=True)
""")


@pytest.fixture(scope="module")
def etcd_url():
    with EtcdCluster.start(3) as c:
        yield c.url


def _replica(url: str, standby: bool) -> CoordinatorProcess:
    return CoordinatorProcess.start("127.0.0.1", 0, hb_timeout_s=1.0, membership_store=url,
                                    deployment_id="dep", standby=standby)


def _line(proc: subprocess.Popen, prefix: str) -> str:
    line = proc.stdout.readline()
    assert line.startswith(prefix), (line, proc.stderr.read() if proc.poll() else "")
    return line[len(prefix):].strip()


def test_a_rank_republishes_in_the_new_leaders_store_and_a_later_rank_finds_it(etcd_url):
    url = f"{etcd_url}/t-exchange"
    first = _replica(url, standby=False)
    second = proc = None
    try:
        second = _replica(url, standby=True)
        proc = subprocess.Popen(
            [sys.executable, "-c", RANK, first.address, url,
             f"127.0.0.1:{first.store_port}"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert _line(proc, "published") == "1"
        os.kill(first.pid, signal.SIGKILL)  # the rank resumes with the standby, elected
        wait_until(lambda: second.leads, 15, "the standby leads")  # within the lease TTL
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert _line(proc, "resumed with") == second.address
        assert _line(proc, "generation") == "1"
        assert _line(proc, "done") == ""
        assert proc.wait(20) == 0
        new = dist.PrefixStore(STORE_PREFIX, dist.TCPStore(
            "127.0.0.1", second.store_port, is_master=False, timeout=timedelta(seconds=5)))
        # the rank's handle, same generation, is in the new leader's store; so is what
        # the rank started after the change put there
        assert new.add(GEN_KEY.format(rank=0), 0) == 1
        assert new.get(HANDLE_KEY.format(rank=0, gen=1)) == b"arena-of-rank-0"
        assert new.get("joiner") == b"here"
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for c in (first, second):
            if c is not None:
                c.close()


def test_the_next_call_after_a_leader_change_moves_to_its_store_and_republishes_first():
    """Without etcd: two plain TCPStores stand for two leaders' stores."""
    old = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    new = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    stores = [old, new]
    published: list[str] = []

    def connect() -> dist.Store:
        return dist.TCPStore("127.0.0.1", stores[0].port, is_master=False,
                             timeout=timedelta(seconds=2))

    s = LeaderStore(connect)
    s.republish.append(lambda c: (c.set("gen", "4"), published.append("again")))
    s.set("k", b"v")
    assert old.get("k") == b"v" and s.moves == 0
    stores.pop(0)
    s.follow()
    assert s.add("gen", 1) == 5  # moved first: republished generation 4, then counted on
    assert published == ["again"] and s.moves == 1 and new.get("gen") == b"5"
