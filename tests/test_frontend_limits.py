"""One request cannot hold up or swamp the front-end (issue 30, item 6): tokenization on
a pool (a giant prompt holds one thread, not all), and a request-body cap (413)."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from _frontend_live import make_chat_model
from transformers import AutoTokenizer

from elasticep.entrypoints.cli import build_parser
from elasticep.entrypoints.serve_args import validate
from elasticep.entrypoints.validate import UsageError
from elasticep.frontend.http_server import DEFAULT_MAX_PAYLOAD_SIZE, create_server
from elasticep.frontend.openai_protocol import ChatCompletionRequest, CompletionRequest
from elasticep.frontend.openai_serving import INLINE_PROMPT_CHARS, OpenAIServing
from elasticep.frontend.tokenizer import TokenizerPool
from elasticep.frontend_link import FrontendChannel
from elasticep.membership.status import DeploymentStatus
from elasticep_testkit.paths import DEMO_MODEL
from elasticep_testkit.serving.datasets import random_requests

pytestmark = pytest.mark.timeout(120)


def test_a_giant_prompt_holds_one_pool_thread_only():
    tok = AutoTokenizer.from_pretrained(DEMO_MODEL)
    tok.model_max_length = 1 << 62
    pool = TokenizerPool(tok, 2)
    giant = "the cat sat on the mat. " * 40_000  # ~1 MB: seconds of encoding here
    small = "How many pets does Ann have?"

    async def race() -> tuple[float, list[float], list[int], list[list[int]]]:
        t0 = time.perf_counter()
        big = asyncio.ensure_future(pool.run(lambda t, p: t.encode(p), giant))
        await asyncio.sleep(0.05)  # the giant one is running
        smalls, waits = [], []
        for _ in range(5):
            s = time.perf_counter()
            smalls.append(await pool.run(lambda t, p: t.encode(p), small))
            waits.append(time.perf_counter() - s)
        big_ids = await big
        return time.perf_counter() - t0, waits, big_ids, smalls

    try:
        giant_s, waits, big_ids, smalls = asyncio.run(race())
    finally:
        pool.close()
    assert big_ids == tok.encode(giant) and smalls == [tok.encode(small)] * 5
    # every small prompt was encoded while the giant one still ran, each far faster
    assert sum(waits) < giant_s / 4, (waits, giant_s)
    with pytest.raises(ValueError, match=">= 1 thread"):
        TokenizerPool(tok, 0)


class NoRanks:
    """A deployment with no rank up yet: requests under the cap get 503."""

    def status(self) -> DeploymentStatus:
        return DeploymentStatus.from_dict({"epoch": 0, "ep_size": 1, "max_ep_size": 1,
                                           "scale_phase": "idle", "ranks": []})

    def scale(self, new_ep_size: int, operation_id: str | None = None) -> dict:
        raise ValueError("not in this test")


def test_bodies_over_the_cap_get_413_before_parsing():
    channel = FrontendChannel()
    server, _ = create_server(DEMO_MODEL, channel, NoRanks(), served_model_name="tiny",
                              max_payload_size=2000)
    server.start()
    try:
        url = server.url + "/v1/completions"
        body = {"model": "tiny", "prompt": "x" * 3000, "max_tokens": 2}
        r = httpx.post(url, json=body)
        assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
        assert r.json()["error"]["message"].endswith(
            "bytes exceeds --max-payload-size (2000 bytes)")

        def chunks():  # no Content-Length: the cap counts what arrives
            for _ in range(4):
                yield b'{"model": "tiny", "prompt": "' + b"y" * 700

        r = httpx.post(url, content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert "more than 2000 bytes exceeds" in r.json()["error"]["message"]
        small = httpx.post(url, content=(b for b in [b'{"model": "tiny", ', b'"prompt": "hi"}']),
                           headers={"content-type": "application/json"})
        assert small.status_code == 503  # replayed in full, parsed, then no rank to route to
        assert httpx.post(url, json={"model": "tiny", "prompt": "hi"}).status_code == 503
    finally:
        server.stop()
        channel.close()


def test_the_flag_is_in_the_http_group_and_checked():
    parser = build_parser()
    args = parser.parse_args(["serve"])
    assert validate(args).max_payload_size == DEFAULT_MAX_PAYLOAD_SIZE == 32 << 20
    assert validate(parser.parse_args(["serve", "--max-payload-size", "4096"])
                    ).max_payload_size == 4096
    with pytest.raises(UsageError, match="--max-payload-size must be >= 1 byte"):
        validate(parser.parse_args(["serve", "--max-payload-size", "0"]))
    serve = next(a for a in parser._subparsers._group_actions[0].choices.values()
                 if any("--max-payload-size" in o.option_strings for o in a._actions))
    group = next(g for g in serve._action_groups
                 if any("--max-payload-size" in o.option_strings for o in g._group_actions))
    assert group.title == "HTTP"


def test_a_tokenizer_that_cannot_be_copied_gets_one_thread():
    class Locked:
        def __init__(self) -> None:
            self.lock = threading.Lock()  # deepcopy refuses it

        def encode(self, text: str) -> list[int]:
            return [len(text)]

    tok = Locked()
    pool = TokenizerPool(tok, 4)
    try:
        assert pool.size == 1
        seen = asyncio.run(pool.run(lambda t, p: (t is tok, t.encode(p)), "abc"))
        assert seen == (True, [3])
    finally:
        pool.close()


def test_a_short_call_runs_on_the_loop_with_its_own_copy_and_a_long_one_on_the_pool():
    tok = AutoTokenizer.from_pretrained(DEMO_MODEL)
    pool = TokenizerPool(tok, 2)

    def where(t, p):
        return threading.current_thread() is threading.main_thread(), t is tok, t.encode(p)

    async def both():
        return (await pool.run(where, "a short prompt", inline=True),
                await pool.run(where, "a short prompt"))

    try:
        inline, pooled = asyncio.run(both())
    finally:
        pool.close()
    assert inline == (True, False, tok.encode("a short prompt"))  # the loop's own copy
    assert pooled == (False, False, tok.encode("a short prompt"))
    single = TokenizerPool(object(), 1)  # no copy: nothing inline, the pool's thread
    try:
        assert asyncio.run(single.run(lambda t, p: threading.current_thread()
                                      is threading.main_thread(), "x", inline=True)) is False
    finally:
        single.close()


class _WhereTok:
    """A tokenizer that notes whether each encode ran on the main thread (the test's
    event loop); its copies (the pool's and the loop's) note into the same list."""

    on_loop: list[bool] = []

    def __init__(self, tok) -> None:
        self.tok = tok

    def encode(self, text: str, **kw) -> list[int]:
        _WhereTok.on_loop.append(threading.current_thread() is threading.main_thread())
        return self.tok.encode(text, **kw)

    def __len__(self) -> int:
        return len(self.tok)

    @property
    def chat_template(self) -> str | None:
        return self.tok.chat_template

    def apply_chat_template(self, *args, **kw):
        return self.tok.apply_chat_template(*args, **kw)


def test_a_benchmark_sized_prompt_is_encoded_on_the_loop_and_a_long_one_on_the_pool():
    tok = AutoTokenizer.from_pretrained(DEMO_MODEL)
    tok.model_max_length = 1 << 62
    # the serving benchmark's 256-token prompts (1.2-1.4k characters)
    prompt = random_requests(1, 256, 1, 1.0, 1, tok, len(tok))[0].prompt
    long = (prompt + " ") * (INLINE_PROMPT_CHARS // len(prompt) + 1)
    serving = OpenAIServing(None, _WhereTok(tok), "m", 1 << 20)
    _WhereTok.on_loop.clear()
    try:
        ids = [asyncio.run(serving.encode_prompt(p, "prompt")) for p in (prompt, long)]
    finally:
        serving.tokenizers.close()
    assert _WhereTok.on_loop == [True, False]
    assert ids == [tok.encode(prompt), tok.encode(long)] and len(ids[0]) >= 250


def test_a_batch_encodes_on_the_loop_only_as_much_text_as_one_prompt_may():
    """Each prompt of a batch under the limit, their sum over it: all go to the pool (on
    the loop they would stall every stream for the whole batch); a small batch stays."""
    tok = AutoTokenizer.from_pretrained(DEMO_MODEL)
    serving = OpenAIServing(None, _WhereTok(tok), "m", 1 << 20)
    part = "How many pets does Ann have? " * 40  # about 1.2k characters
    big = [part] * (INLINE_PROMPT_CHARS // len(part) + 1)
    _WhereTok.on_loop.clear()
    try:
        for prompts in ([part, part], big):
            out = asyncio.run(serving._completion_inputs(CompletionRequest(
                model="m", prompt=prompts, max_tokens=1)))
            assert [ids for ids, _ in out] == [tok.encode(p) for p in prompts]
    finally:
        serving.tokenizers.close()
    assert _WhereTok.on_loop == [True, True] + [False] * len(big)


def test_a_short_chat_is_rendered_on_the_loop_and_a_long_one_on_the_pool(tmp_path):
    tok = AutoTokenizer.from_pretrained(make_chat_model(tmp_path / "chat"))
    serving = OpenAIServing(None, _WhereTok(tok), "m", 1 << 20)
    short = "How many pets does Ann have? " * 40  # about 1.2k characters
    long = short * (INLINE_PROMPT_CHARS // len(short) + 1)
    _WhereTok.on_loop.clear()
    try:
        ids = [asyncio.run(serving._chat_inputs(ChatCompletionRequest(
            model="m", messages=[{"role": "user", "content": text}])))[0]
            for text in (short, long)]
    finally:
        serving.tokenizers.close()
    assert _WhereTok.on_loop == [True, False]
    text = tok.apply_chat_template([{"role": "user", "content": short}],
                                   add_generation_prompt=True, tokenize=False)
    assert short in text and ids[0] == tok.encode(text, add_special_tokens=False)
