"""The real HTTP server in-process with one real engine worker (ep_size 1, a thread) on
a model directory: what the front-end API tests share (not a test module)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from elasticep.elastic.serve_loop import run_engine_worker
from elasticep.engine.llm_engine import EngineConfig, LLMEngine
from elasticep.frontend.http_server import HttpServer, create_server
from elasticep.frontend.membership_source import ConnectedWorkers
from elasticep.frontend_link import FrontendChannel, WorkerChannel
from elasticep_testkit.chat_templates import demo_with_chat_template

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def make_chat_model(dst: Path) -> Path:
    """The demo model plus a chat template (weights are symlinked, not copied)."""
    return demo_with_chat_template(dst, TEMPLATE)


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``predicate`` every 50 ms; TimeoutError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


@contextlib.contextmanager
def engine_server(model_dir: Path, name: str, api_key: str | None = None,
                  prepare: Callable[[LLMEngine], Any] = lambda _: None,
                  ) -> Iterator[tuple[HttpServer, Any, LLMEngine, Any]]:
    """Serve ``model_dir`` as ``name``; yields (server, frontend, engine, prepared).

    ``prepare(engine)`` runs before the worker thread owns the engine (references);
    the server answers /health 200 when this yields. Everything is stopped after.
    """
    engine = LLMEngine.from_pretrained(model_dir, progress=False,
                                       config=EngineConfig(max_total_tokens=1024))
    prepared = prepare(engine)
    with rank_server(model_dir, engine, name, api_key) as (server, frontend):
        yield server, frontend, engine, prepared


@contextlib.contextmanager
def rank_server(model_dir: Path, engine: Any, name: str, api_key: str | None = None,
                idle_poll_s: float = 0.05) -> Iterator[tuple[HttpServer, Any]]:
    """The front-end of ``model_dir`` (served as ``name``) over one rank thread that runs
    ``engine`` (any step engine of the rank loop); yields (server, frontend) once
    /health answers 200, and stops both after."""
    channel = FrontendChannel()
    server, frontend = create_server(model_dir, channel,
                                     ConnectedWorkers(lambda: channel.connected),
                                     served_model_name=name, api_key=api_key)
    stop = threading.Event()

    def work() -> None:
        wc = WorkerChannel(channel.endpoints, rank=0)
        try:
            run_engine_worker(engine, wc, 0, stop, idle_poll_s=idle_poll_s)
        finally:
            wc.close()

    worker = threading.Thread(target=work, name="rank-worker", daemon=True)
    worker.start()
    server.start()
    try:
        wait_for(lambda: httpx.get(server.url + "/health").status_code == 200, 20,
                 "a healthy rank")
        yield server, frontend
    finally:
        server.stop()
        stop.set()
        worker.join(10)
        channel.close()
