"""Synchronous batch generation on a multi-rank deployment (``generate --ep-size N``).

The driver is a front-end without HTTP: it owns a :class:`FrontendChannel`, a
:class:`~elasticep.deploy.Deployment` (whose ``membership()`` is the
``MembershipSource``) and a :class:`Frontend` on a private asyncio loop. Requests are
spread over the healthy ranks (one data-parallel replica per rank) by the tracker; when
membership reports a rank failed, its requests are resumed on survivors as prompt +
generated tokens, so the caller sees complete outputs.

    driver = BatchDriver.launch(DeploymentConfig(model=..., ep_size=4, ...), tok.decode)
    outs = driver.generate([ids0, ids1, ...], SamplingParams(max_tokens=32))
    driver.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from elasticep.config import DeploymentConfig
from elasticep.deploy import Deployment
from elasticep.engine.request import SamplingParams, TokenLogprobs
from elasticep.entrypoints.validate import make_log_dir
from elasticep.frontend.core import Frontend, FrontendConfig
from elasticep.frontend.incremental_text import Decode
from elasticep.frontend.request_tracker import RequestEvent
from elasticep.frontend_link import FrontendChannel

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Completion:
    """One prompt's result.

    Attributes:
        token_ids: generated ids (EOS included when generation stopped on it).
        text: streamed text (stop strings cut).
        finish_reason: "stop", "length" or "abort".
        error: set when the request failed.
        logprobs: each generated token's logprob and alternatives, when the request
            asked for them (``SamplingParams.logprobs``), else empty.
        prompt_logprobs: the prompt tokens' (positions 1..P-1), when asked for.
    """

    token_ids: list[int]
    text: str
    finish_reason: str | None
    error: str | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None


class BatchDriver:
    """Runs batches of prompts on a deployment and waits for every completion.

    Args:
        deployment: a started deployment whose front-end addresses are ``channel``'s.
        channel: the bound front-end channel.
        decode: token ids -> text (the tokenizer's decode).
        config: front-end timing.
    """

    def __init__(self, deployment: Deployment, channel: FrontendChannel, decode: Decode,
                 config: FrontendConfig | None = None) -> None:
        self.deployment = deployment
        self.channel = channel
        self.loop = asyncio.new_event_loop()
        self.frontend = Frontend(channel, deployment.membership(lambda: channel.connected),
                                 decode,
                                 config=config or FrontendConfig(membership_poll_s=0.05))
        self._ids = 0
        self.loop.run_until_complete(self.frontend.start())

    @classmethod
    def launch(cls, config: DeploymentConfig, decode: Decode, *, fault: str | None = None,
               log_dir: str | None = None, env: dict[str, str] | None = None,
               ready_timeout_s: float = 180.0) -> BatchDriver:
        """Bind a channel, start the deployment with its addresses, wait until every
        launch rank is healthy and connected.

        Args:
            log_dir: where worker ``r``'s output goes (``rank<r>.log``); None: a new
                temporary directory, named in one log line.

        Raises:
            UsageError: ``log_dir`` cannot be made or written.
            RankStartupError: a launch rank exited while loading (a RuntimeError whose
                message is one line: the rank, its exit status, its last exception and
                the log file that holds the whole traceback).
            TimeoutError / RuntimeError: the ranks did not come up.
        """
        # rank tracebacks belong in files, not in the caller's stderr; a given directory
        # is checked here, before the coordinator or any rank starts
        named = log_dir is not None
        log_dir = str(make_log_dir(log_dir, "elasticep-logs-"))
        if not named:
            logger.info("worker logs in %s", log_dir)
        channel = FrontendChannel(host="127.0.0.1")
        config = replace(config, frontend_request_addr=channel.endpoints.request_addr,
                         frontend_output_addr=channel.endpoints.output_addr)
        drivers: list[BatchDriver] = []  # the one built below, once it exists

        def coordinator_died(code: int) -> None:
            # its watcher thread: the ranks cannot go on without it, so end the batch now
            # with that reason instead of at the batch's timeout
            for d in drivers:
                d.frontend.fail_all(f"the coordinator process exited with {code}; the "
                                    "deployment's membership died with it")

        try:
            dep = Deployment.start(config, fault=fault, env=env, log_dir=log_dir,
                                   on_coordinator_exit=coordinator_died)
        except BaseException:
            channel.close()
            raise
        try:
            dep.wait_healthy(timeout_s=ready_timeout_s)
            driver = cls(dep, channel, decode)
            drivers.append(driver)
            driver.wait_routable(range(config.ep_size), ready_timeout_s)
        except BaseException:
            dep.stop()
            channel.close()
            raise
        return driver

    def wait_routable(self, ranks: Sequence[int] | range, timeout_s: float = 60.0) -> None:
        """Block until the front-end may route to every rank in ``ranks``.

        Raises:
            TimeoutError: not within ``timeout_s``.
        """
        want = set(ranks)

        async def wait() -> None:
            deadline = time.monotonic() + timeout_s
            await self.frontend.refresh_membership()  # the view may be stale while idle
            while not want <= set(self.frontend.tracker.healthy_ranks()):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks {sorted(want)} not routable after {timeout_s}s "
                                       f"(routable: {self.frontend.tracker.healthy_ranks()})")
                await self.frontend.refresh_membership()
                await asyncio.sleep(0.05)

        self.loop.run_until_complete(wait())

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams], timeout_s: float = 600.0,
                 on_event: Callable[[int, RequestEvent], None] | None = None) -> list[Completion]:
        """Run every prompt to completion, spread over the healthy ranks.

        Args:
            prompts: token ids per prompt.
            params: sampling settings shared by all prompts, or one per prompt.
            timeout_s: bound of the whole batch (seconds).
            on_event: called on the driver's loop with (prompt index, event), e.g. to
                inject a failure after some tokens.

        Returns:
            Completions in input order.

        Raises:
            TimeoutError: the batch did not finish in time.
            NoRankAvailableError: no healthy rank.
            ValueError: a list of params whose length is not the number of prompts.
        """
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) \
            else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(per_prompt)} sampling params for {len(prompts)} prompts")

        async def one(i: int, ids: Sequence[int]) -> Completion:
            self._ids += 1
            stream = self.frontend.submit(f"batch-{self._ids}-{i}", list(ids), per_prompt[i])
            tokens: list[int] = []
            lps: list[TokenLogprobs] = []
            prompt_lps = None
            text, finish, error = "", None, None
            async with contextlib.aclosing(stream):
                async for ev in stream:
                    if on_event is not None:
                        on_event(i, ev)
                    tokens.extend(ev.token_ids)
                    lps.extend(ev.logprobs)
                    if ev.prompt_logprobs is not None:
                        prompt_lps = ev.prompt_logprobs
                    text += ev.text
                    finish, error = ev.finish_reason, ev.error
            return Completion(tokens, text, finish, error, tuple(lps), prompt_lps)

        tasks = [self.loop.create_task(one(i, p)) for i, p in enumerate(prompts)]

        async def run() -> list[Completion]:
            _, pending = await asyncio.wait(tasks, timeout=timeout_s)
            if pending:
                raise TimeoutError(f"the batch did not finish within {timeout_s:g} s")
            return [task.result() for task in tasks]

        batch = self.loop.create_task(run())
        try:
            return self.loop.run_until_complete(batch)
        except BaseException:
            # Ctrl-C (KeyboardInterrupt) stops the loop with the batch's requests still
            # pending on it, as a timeout or an error leaves them: cancel them, so that
            # their streams close and the ranks abort them, before the error goes up
            everything = [batch, *tasks]
            for task in everything:
                task.cancel()
            with contextlib.suppress(BaseException):
                self.loop.run_until_complete(asyncio.wait(everything))
            for task in everything:
                if task.done() and not task.cancelled():
                    task.exception()  # retrieved: it goes up from here
            raise

    def close(self) -> None:
        """Stop the front-end tasks, the deployment (by pid) and the channel."""
        try:
            self.loop.run_until_complete(self.frontend.stop())
            self.loop.close()
        finally:
            self.deployment.stop()
            self.channel.close()

    def __enter__(self) -> BatchDriver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
