"""``--api-server-count``: several HTTP front-end processes on one port.

`elasticep serve` of the demo model streams the same greedy tokens with two front-end
processes (membership in etcd) as with one (embedded store). End to end over stub ranks (the real front-end, link and rank loop; tokens at a set
rate): every request of a concurrent load is served with the same tokens whichever
process took it, both processes serve, a SIGKILLed extra process is relaunched and the
node serves on, ``/metrics`` counts each request once across the processes, and the
ranks abort the requests of a process SIGKILLed with its streams open (only those),
and a process whose loop stalls (SIGSTOP) is killed after the stall timeout, its
requests aborted and a new process serving the same tokens. The pool's restart budget
and stall check as pure functions, the beat as a loop callback; a process that dies
after its settings but before it serves is relaunched (stand-in processes).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import re
import signal
import socket
import time
import uuid
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import httpx
import pytest

from elasticep.frontend import api_server_pool
from elasticep.frontend.api_server_pool import (
    MAX_RESTARTS,
    RESTART_WINDOW_S,
    ApiServerPool,
    count_death,
)
from elasticep.frontend.loop_beats import STALL_TIMEOUT_S, BeatsSeen, beat, stall_check
from elasticep.frontend_link import LinkEndpoints
from elasticep_testkit.etcd_cluster import EtcdCluster
from elasticep_testkit.harness.load import run_batch
from elasticep_testkit.harness.serve_process import ServeProcess
from elasticep_testkit.paths import DEMO_MODEL
from elasticep_testkit.serving.stub_engine import server_command, stats_path
from tests._serve_fixtures import RESULTS_TIMEOUT_S, assert_complete, prompts, start_serve

pytestmark = pytest.mark.timeout(120)

STEPS_PER_S = 200.0
MAX_TOKENS = 12


async def _complete_all(url: str, prompts: list[str]) -> list[str]:
    """Every prompt at once, each on a connection of its own; their completions."""

    async def one(prompt: str) -> str:
        async with httpx.AsyncClient(base_url=url, timeout=60.0) as client:
            r = await client.post("/v1/completions", json={
                "model": str(DEMO_MODEL), "prompt": prompt, "max_tokens": MAX_TOKENS,
                "temperature": 0})
            r.raise_for_status()
            body = r.json()
            assert body["usage"]["completion_tokens"] == MAX_TOKENS
            return body["choices"][0]["text"]

    return await asyncio.gather(*(one(p) for p in prompts))


def _served_total(metrics: str) -> float:
    return sum(float(v) for v in re.findall(
        r'^elasticep_requests_total\{endpoint="completions",outcome="[a-z_]+"\} (\S+)$',
        metrics, re.M))


def _scrape(url: str) -> str:
    """``GET /metrics`` on a connection of its own."""
    return httpx.get(f"{url}/metrics", timeout=10.0).raise_for_status().text


def _child_pids(log: str) -> list[int]:
    return [int(p) for p in re.findall(r"api server 1 \(pid (\d+)\) serving", log)]


def _wait_log(serve: ServeProcess, pred, what: str, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        log = serve.tail(1 << 22)
        if pred(log):
            return log
        time.sleep(0.1)
    raise TimeoutError(f"{what} not logged in {timeout_s} s:\n{serve.tail(4000)}")


@contextlib.contextmanager
def _two_front_ends(steps_per_s: float, *flags: str) -> Iterator[tuple[ServeProcess, int]]:
    """The stub server with two front-end processes, and the extra one's pid once it
    serves."""
    with ServeProcess.start(["--model", str(DEMO_MODEL), "--api-server-count", "2", *flags],
                            ready_timeout_s=90, program=server_command(steps_per_s)) as serve:
        yield serve, _child_pids(_wait_log(serve, _child_pids, "the extra front-end serving"))[0]


def test_two_front_end_processes_serve_share_metrics_and_survive_a_kill():
    prompts = [f"request {i} says the weather is {'fine' if i % 2 else 'cold'}"
               for i in range(48)]
    with _two_front_ends(STEPS_PER_S) as (serve, first):
        texts = asyncio.run(_complete_all(serve.url, prompts))
        # the stub's tokens depend on the prompt only: the same prompt gives the same
        # text whichever process served it
        by_prompt = dict(zip(prompts, texts, strict=True))
        assert all(texts)
        again = asyncio.run(_complete_all(serve.url, prompts[:8]))
        assert again == [by_prompt[p] for p in prompts[:8]]
        # any process answers a scrape with the node's total: fresh connections, so
        # that the scrapes are spread over the processes
        assert [_served_total(_scrape(serve.url)) for _ in range(10)] == [56] * 10

        os.kill(first, signal.SIGKILL)
        log = _wait_log(serve, lambda text: len(_child_pids(text)) == 2,
                        "the relaunched front-end serving")
        assert f"api server 1 (pid {first}) exited with -9" in log
        relaunched = _child_pids(log)[1]
        assert relaunched != first
        texts = asyncio.run(_complete_all(serve.url, prompts))
        assert texts == [by_prompt[p] for p in prompts]  # the node serves on, the same
        # the dead process's count stays
        assert [_served_total(_scrape(serve.url)) for _ in range(10)] == [104] * 10
        assert serve.stop() == []  # no process left behind
        log = serve.tail(1 << 22)
    # the relaunched process stopped cleanly with its count (which process accepts a
    # connection on the shared socket is the kernel's choice: on a loaded machine one
    # process can take a whole load, so no split between them is asserted)
    served = re.findall(rf"api server 1 \(pid {relaunched}\): stopping after (\d+) requests",
                        log)
    assert served and 0 <= int(served[0]) <= 48, log[-3000:]
    # serve's front-end, the extra process and its relaunch each froze its start-up
    # heap (its imports: torch, the tokenizer) before serving
    frozen = [int(n) for n in re.findall(r"froze (\d+) start-up objects", log)]
    assert len(frozen) == 3 and min(frozen) > 50_000, frozen
    # an extra process's exit left its frozen heap uncollected, and nanobind (triton's
    # bindings) printed a report of hundreds of "leaked" objects at every stop
    assert "leaked" not in log, log[-3000:]


def _greedy_texts(texts: list[str], *args: str) -> tuple[list[str], str]:
    """The greedy completions of ``texts`` by `serve --ep-size 1 ARGS`, all at once, and
    serve's log."""
    with start_serve("--ep-size", "1", *args) as serve:
        records = run_batch(serve.client, serve.model_name(), texts, 16, RESULTS_TIMEOUT_S)
        if "--membership-store" in args:  # both processes are in the directory, and
            for _ in range(6):  # each shows it
                body = httpx.get(f"{serve.url}/elastic_ep_status", timeout=10.0).json()
                assert sorted(body["frontends"]) == ["node0", "node0-api1"], body
        assert serve.stop() == []
        log = serve.tail(1 << 22)
    assert_complete(records, 16)
    return [r.text for r in records], log


def test_serve_streams_the_same_greedy_tokens_with_two_front_end_processes_under_etcd():
    """Two front-end processes with the membership in etcd (the extra one announces
    itself and the rank links to it through the directory) stream the same greedy
    tokens as one process with the embedded store."""
    texts = prompts(12)
    with EtcdCluster.start(1) as cluster:
        two, log = _greedy_texts(texts, "--api-server-count", "2", "--membership-store",
                                 f"{cluster.url}/t-{uuid.uuid4().hex[:8]}")
    assert two == _greedy_texts(texts)[0]
    # the extra process stopped cleanly with its count; no split between the processes
    # is asserted (the kernel picks who accepts; one process can take all 12 under load)
    served = re.findall(r"api server 1 \(pid \d+\): stopping after (\d+) requests", log)
    assert served and 0 <= int(served[0]) <= len(texts), served


def test_the_restart_budget_counts_deaths_within_the_window_only():
    assert MAX_RESTARTS == 3
    deaths: tuple[float, ...] = ()
    for t in (0.0, 10.0, 20.0):  # relaunched up to the budget
        deaths, relaunched = count_death(deaths, t)
        assert relaunched
    assert count_death(deaths, 30.0) == ((0.0, 10.0, 20.0, 30.0), False)  # a crash loop
    deaths = ()  # deaths spread out: the old ones leave the window, relaunched for ever
    for t in (0.0, 200.0, 400.0, 600.0, 800.0, 10_000.0):
        deaths, relaunched = count_death(deaths, t)
        assert relaunched, (t, deaths)
    assert deaths == (10_000.0,)
    # a death RESTART_WINDOW_S ago has left the window
    assert count_death((0.0, 1.0, 2.0), RESTART_WINDOW_S) == ((1.0, 2.0, RESTART_WINDOW_S),
                                                               True)


def test_the_stall_check_counts_a_silent_loop_of_a_serving_process_only():
    timeout = STALL_TIMEOUT_S
    spawned = BeatsSeen(0, 100.0)
    # starting: no beat yet, however long it takes
    assert stall_check(spawned, 0, 100.0 + 10 * timeout, False) == (spawned, None)
    seen, silent = stall_check(spawned, 1, 105.0, False)  # its first beat: it serves
    assert (seen, silent) == (BeatsSeen(1, 105.0), None)
    for k in range(2, 40):  # beats keep it alive however long it runs
        seen, silent = stall_check(seen, k, 105.0 + k * timeout / 2, False)
        assert silent is None
    last = seen.since
    assert stall_check(seen, 39, last + timeout, False) == (seen, None)
    assert stall_check(seen, 39, last + timeout + 1.5, False) == (seen, timeout + 1.5)
    assert stall_check(seen, 39, last + 3 * timeout, True) == (seen, None)  # stopping
    # a watcher held up for longer than the timeout finds the counter moved: alive
    later = last + 3 * timeout
    assert stall_check(seen, 45, later, False) == (BeatsSeen(45, later), None)
    assert stall_check(seen, 39, last + 2.0, False, timeout_s=1.0) == (seen, 2.0)


def test_the_beat_is_a_loop_callback_that_a_held_loop_stops():
    beats = ctypes.c_uint64(0)

    async def run() -> tuple[int, int]:
        asyncio.get_running_loop().call_soon(beat, beats, 0.01)
        await asyncio.sleep(0.2)
        running = beats.value
        time.sleep(0.2)  # a call that holds the loop: its process lives on, no beat
        return running, beats.value

    running, held = asyncio.run(run())
    assert running >= 3 and held == running, (running, held)


SLOW_STEPS_PER_S = 40.0  # the streams below outlast the test (their max_tokens take 20 s)
LONG_TOKENS = 800


class _Stream:
    """One long streamed completion on a connection of its own, read in a task: its
    token chunks so far, and whether its connection was cut."""

    def __init__(self, url: str, prompt: str) -> None:
        self.chunks, self.cut = 0, False
        self.first = asyncio.Event()
        self.task = asyncio.create_task(self._read(url, prompt))

    async def _read(self, url: str, prompt: str) -> None:
        body = {"model": str(DEMO_MODEL), "prompt": prompt, "max_tokens": LONG_TOKENS,
                "temperature": 0, "stream": True}
        try:
            async with httpx.AsyncClient(base_url=url, timeout=30.0) as client, \
                    client.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        self.chunks += 1
                        self.first.set()
        except httpx.TransportError:  # its process died
            self.cut = True


async def _start_streams(url: str, n: int, tag: str) -> list[_Stream]:
    """``n`` streams, once each runs on the ranks (its first token came)."""
    streams = [_Stream(url, f"stream {i} of {tag}") for i in range(n)]
    await asyncio.wait_for(asyncio.gather(*(s.first.wait() for s in streams)), 20.0)
    return streams


async def _open_streams(url: str, n: int, elsewhere: int) -> list[_Stream]:
    """``n`` running streams (:func:`_start_streams`) served by the node's processes
    other than pid ``elsewhere``: the kernel picks which process accepts, so
    ``elsewhere`` is stopped (SIGSTOP) until they are accepted."""
    os.kill(elsewhere, signal.SIGSTOP)
    try:
        return await _start_streams(url, n, str(elsewhere))
    finally:
        os.kill(elsewhere, signal.SIGCONT)


async def _assert_flowing(streams: list[_Stream]) -> None:
    """Each of ``streams`` gets more tokens and keeps its connection."""
    before = [s.chunks for s in streams]
    await asyncio.sleep(0.3)
    assert all(not s.cut and s.chunks > n for s, n in zip(streams, before, strict=True))


async def _close(streams: list[_Stream]) -> None:
    for s in streams:
        s.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await s.task


def _rank_running(log_dir: Path) -> int:
    return json.loads(stats_path(log_dir, 0).read_text())["running"]


async def _wait_running(log_dir: Path, want: int, timeout_s: float = 10.0) -> None:
    """Until stub rank 0 reports ``want`` running requests (it writes every second)."""
    deadline = time.monotonic() + timeout_s
    while (got := _rank_running(log_dir)) != want:
        assert time.monotonic() < deadline, f"rank runs {got} requests, not {want}"
        await asyncio.sleep(0.1)


def test_the_ranks_abort_the_requests_of_a_killed_front_end_process_only():
    with _two_front_ends(SLOW_STEPS_PER_S) as (serve, child):
        log_dir = serve.log_path.parent

        async def scenario() -> None:
            doomed = await _open_streams(serve.url, 3, elsewhere=serve.proc.pid)
            kept = await _open_streams(serve.url, 2, elsewhere=child)
            try:
                await _wait_running(log_dir, 5)
                os.kill(child, signal.SIGKILL)
                await asyncio.wait_for(asyncio.gather(*(s.task for s in doomed)), 10.0)
                assert all(s.cut for s in doomed)
                await _wait_running(log_dir, 2)  # the survivors' requests only
                await _assert_flowing(kept)
            finally:
                await _close(kept)

        asyncio.run(scenario())
        _wait_log(serve, lambda text: f"api server 1 (pid {child}) exited with -9; its "
                  "streams failed and the ranks abort its requests; relaunching it on the "
                  "same socket (relaunch 1 of at most 3 within 300 s)" in text,
                  "the relaunch")
        assert serve.stop() == []


# the stall timeout the stub server gets below: short, and still far longer than the
# loop of a light front-end process holds on a loaded two-core machine
TEST_STALL_S = 3.0


def test_a_stalled_front_end_process_is_killed_its_requests_aborted_and_replaced():
    short = [f"short {i}, a stub's tokens depend on its prompt only" for i in range(4)]
    with _two_front_ends(SLOW_STEPS_PER_S, "--api-server-stall-timeout-s",
                         str(TEST_STALL_S)) as (serve, child):
        log_dir = serve.log_path.parent

        async def scenario() -> None:
            doomed = await _open_streams(serve.url, 3, elsewhere=serve.proc.pid)
            await _wait_running(log_dir, 3)
            os.kill(child, signal.SIGSTOP)  # alive, its loop runs no more
            stopped, kept = time.monotonic(), []
            try:
                # accepted by serve's own process: the stopped one accepts nothing
                kept = await _start_streams(serve.url, 2, "serve's own process")
                texts = await _complete_all(serve.url, short)
                await asyncio.wait_for(asyncio.gather(*(s.task for s in doomed)),
                                       TEST_STALL_S + 15.0)
                assert all(s.cut for s in doomed)  # an error, not a hang
                # not before its time (its last beat came up to a beat period before the
                # stop, later on a busy machine)
                assert time.monotonic() - stopped > TEST_STALL_S / 2
                await _wait_running(log_dir, 2)  # the stalled process's requests aborted
                await _assert_flowing(kept)
                await asyncio.to_thread(_wait_log, serve, lambda t: len(_child_pids(t)) == 2,
                                        "the relaunched front-end serving")
                # the new process serves, the same tokens as serve's own process
                assert await _complete_on_extra(serve, short) == texts
            finally:
                if not all(s.cut for s in doomed):  # not killed: let the stop end it
                    os.kill(child, signal.SIGCONT)
                await _close(kept)

        asyncio.run(scenario())
        log = serve.tail(1 << 22)
        assert re.search(rf"api server 1 \(pid {child}\) stalled: its event loop has not "
                         rf"beaten for [\d.]+ s \(stall timeout {TEST_STALL_S:g} s\); "
                         "killing it", log), log[-3000:]
        assert (f"api server 1 (pid {child}) exited with -9; its streams failed and the "
                "ranks abort its requests; relaunching it") in log
        with pytest.raises(ProcessLookupError):  # SIGKILLed and reaped
            os.kill(child, 0)
        assert serve.stop() == []


async def _complete_on_extra(serve: ServeProcess, texts: list[str]) -> list[str]:
    """:func:`_complete_all` served by the extra process (serve's own stopped meanwhile)."""
    os.kill(serve.proc.pid, signal.SIGSTOP)
    try:
        return await _complete_all(serve.url, texts)
    finally:
        os.kill(serve.proc.pid, signal.SIGCONT)


def _dies_once_before_serving(index: int, link_host: str, ports: tuple[int, int],
                              sock: socket.socket, conn: Connection, metrics_dir: str, parent_pid: int,
                              grace_s: float, origin_id: str, beats: ctypes.c_uint64) -> None:
    """A stand-in for ``api_server_main``: binds nothing, takes its settings, and the
    first incarnation is SIGKILLed before it reports serving; the next one serves
    (sleeps until the pool's SIGTERM; it never beats, which the pool takes for a
    process still starting)."""
    conn.send(LinkEndpoints(f"tcp://{link_host}:{ports[0] or 5}",
                            f"tcp://{link_host}:{ports[1] or 6}"))
    conn.recv()
    marker = Path(metrics_dir) / "died"
    if not marker.exists():
        marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)
    conn.send(os.getpid())
    time.sleep(60)


def test_a_process_that_dies_before_it_serves_is_relaunched_once(monkeypatch):
    # serve exited 1 ("exited with -9 before it could start serving") when an extra
    # process died in that window; the watcher, which saw the same death, must not
    # relaunch it a second time (nor name the relaunch's origin to the ranks)
    monkeypatch.setattr(api_server_pool, "enable_multiprocess", lambda _dir: None)
    monkeypatch.setattr(api_server_pool, "api_server_main", _dies_once_before_serving)
    dead: list[str] = []
    with socket.create_server(("127.0.0.1", 0)) as sock:
        pool = ApiServerPool(1, "127.0.0.1", sock, 1.0, on_give_up=dead.append)
        try:
            pool.start()
            first = pool.origins[0]
            pool.serve("settings", on_death=dead.append)  # type: ignore[arg-type]
            pool.wait_serving()
            proc = pool._procs[0]
            time.sleep(0.6)  # the watcher's next looks
            assert dead == [first]
            assert len(pool.deaths[0]) == 1
            assert pool._procs[0] is proc and proc is not None and proc.is_alive()
            assert pool.origins[0] != first
        finally:
            pool.stop(5.0)


def test_a_stop_before_the_processes_serve_does_not_wait_for_their_start_up(monkeypatch):
    # Ctrl-C of serve while it started: an extra process waiting for its spec acts on
    # its SIGTERM only once its start-up ends, and the stop waited out grace_s + 5 s
    # before it killed it; one that has not served holds no stream and is killed at once
    monkeypatch.setattr(api_server_pool, "enable_multiprocess", lambda _dir: None)
    with socket.create_server(("127.0.0.1", 0)) as sock:
        pool = ApiServerPool(1, "127.0.0.1", sock, 30.0)
        pool.start()  # bound its link; now it waits for the spec, as serve's start runs
        proc = pool._procs[0]
        assert proc is not None and proc.is_alive()
        t0 = time.monotonic()
        pool.stop()
        took = time.monotonic() - t0
    assert not proc.is_alive() and proc.exitcode == -signal.SIGKILL
    assert took < 10.0, f"the stop took {took:.1f} s (it waited out the grace)"
