"""Shared pieces of the multi-rank EP tests and of ``bench/recovery_windows.py``: a
``generate --ep-size`` launch, the ep_size=1 reference and the near-tie rule, and the
Gloo rank helpers of the in-process EP tests.

The ep_size=1 reference (greedy tokens plus each step's top-2 logit margin) is computed
once per test session and reused by every EP test module.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import torch

from elasticep.engine.request import SamplingParams
from elasticep_testkit.paths import DEMO_MODEL
from elasticep_testkit.prompts import gsm8k_prompts
from elasticep_testkit.torch_threads import one_torch_thread

NEAR_TIE = 1e-3
NUM_PROMPTS = 16
GREEDY = SamplingParams(max_tokens=32, ignore_eos=True)


@functools.cache
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO_MODEL)


@functools.cache
def prompts() -> tuple[tuple[int, ...], ...]:
    """16 GSM8K test questions of the repository's sample, tokenized."""
    return tuple(tuple(tokenizer()(p).input_ids) for p in gsm8k_prompts(NUM_PROMPTS))


def reference() -> tuple[list[list[int]], list[list[float]]]:
    """ep_size=1 greedy outputs of :func:`prompts` and the top-2 margin at each token."""
    return reference_for(str(DEMO_MODEL), prompts())


@functools.cache
def reference_for(model: str, prompt_ids: tuple[tuple[int, ...], ...]) -> tuple[list[list[int]], list[list[float]]]:
    """ep_size=1 greedy outputs of ``prompt_ids`` on ``model`` and the top-2 margin at each token."""
    from elasticep.engine.llm_engine import LLMEngine

    with one_torch_thread():
        engine = LLMEngine.from_pretrained(model, dtype=torch.float32, progress=False)
        outs = engine.generate([list(p) for p in prompt_ids], GREEDY)
        margins = []
        for p, out in zip(prompt_ids, outs, strict=True):
            logits = engine.prompt_logits(list(p) + out[:-1])[len(p) - 1:]
            top2 = torch.topk(logits, 2, dim=-1).values
            margins.append((top2[:, 0] - top2[:, 1]).tolist())
    return outs, margins


def assert_equal_under_near_tie_rule(got: list[list[int]], ref: list[list[int]],
                                     margins: list[list[float]], what: str,
                                     near_tie: float = NEAR_TIE, cap: int | None = None,
                                     ) -> list[str]:
    """Token-for-token equality of ``got`` with ``ref``, under the near-tie rule.

    A prompt may differ only from a position where the reference's top-2 margin is
    below ``near_tie`` (its continuation then legitimately diverges), and at most ``cap``
    prompts may use that excuse (default: one in eight, 2 of 16: fp32 near ties are
    rare, so more means a real difference). Each use is printed and reported as a
    warning.

    Args:
        got, ref: token ids per prompt; margins: the reference's top-2 logit margin at
            each of its tokens (in the unit of ``near_tie``).
        what: names the comparison in messages.
        near_tie: the margin below which a token may differ.
        cap: the most prompts excused; None: ``max(1, len(ref) // 8)``.

    Returns:
        One line per excused prompt.
    """
    excused = []
    for i, (g, r) in enumerate(zip(got, ref, strict=True)):
        if g == r:
            continue
        j = next((k for k, (a, b) in enumerate(zip(g, r, strict=False)) if a != b), min(len(g), len(r)))
        assert j < len(r) and j < len(g) and margins[i][j] < near_tie, (
            f"{what}: prompt {i} differs at token {j} (margin "
            f"{margins[i][j] if j < len(r) else 'n/a'}): got {g} want {r}")
        excused.append(f"{what}: prompt {i} token {j} near tie (margin {margins[i][j]:.2e})")
    for e in excused:
        print(e)
        warnings.warn(e, stacklevel=2)
    cap = max(1, len(ref) // 8) if cap is None else cap
    assert len(excused) <= cap, f"{what}: {len(excused)} near ties excused, at most {cap}: {excused}"
    return excused


def assert_matches_reference(got: list[list[int]], what: str, expected=None) -> list[str]:
    """:func:`assert_equal_under_near_tie_rule` against the ep_size=1 reference:
    ``expected`` is ``(tokens, margins)`` from :func:`reference_for`; None = the demo
    model's :func:`reference`."""
    ref, margins = expected or reference()
    return assert_equal_under_near_tie_rule(got, ref, margins, what)


def launch(tmp_path_factory, **overrides):
    """A BatchDriver over a fresh CPU deployment of the demo model (4 ranks unless
    ``ep_size`` says otherwise); worker logs go to a temp dir (``driver.log_dir``)."""
    from elasticep.config import DeploymentConfig
    from elasticep.entrypoints.batch_driver import BatchDriver

    log_dir = tmp_path_factory.mktemp("ep-logs")
    fault = overrides.pop("fault", None)
    ep_size = overrides.pop("ep_size", 4)
    cfg = DeploymentConfig(model=str(overrides.pop("model", DEMO_MODEL)), ep_size=ep_size,
                           max_ep_size=overrides.pop("max_ep_size", ep_size),
                           heartbeat_timeout_s=10.0, **overrides)
    driver = BatchDriver.launch(cfg, tokenizer().decode, fault=fault, log_dir=str(log_dir),
                                ready_timeout_s=120)
    driver.log_dir = log_dir
    return driver


def kill_after(driver, rank: int, events: int):
    """An ``on_event`` callback that SIGKILLs ``rank`` (by its pid) after ``events`` tokens."""
    import os
    import signal

    seen = [0]
    pid = driver.deployment.pids()[rank]

    def on_event(_i, _ev):
        seen[0] += 1
        if seen[0] == events:
            os.kill(pid, signal.SIGKILL)

    return on_event


def worker_log(driver) -> str:
    """All worker log lines so far."""
    return "\n".join(p.read_text() for p in sorted(Path(driver.log_dir).glob("rank*.log")))


def generated(driver, prompt_ids=None, **kwargs) -> list[list[int]]:
    """Run ``prompt_ids`` (default: the 16 GSM8K prompts) on the deployment; every request must succeed."""
    outs = driver.generate([list(p) for p in prompt_ids or prompts()], GREEDY, timeout_s=120, **kwargs)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.token_ids for o in outs]


def init_gloo_rank(rank: int, port: int, world: int) -> None:
    """In a spawned rank of :func:`run_gloo_ranks`: one intra-op thread, then a Gloo
    WORLD over the parent's TCPStore."""
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))


def finish_gloo_rank(results: dict, rank: int, outdir: str) -> None:
    """Save a rank's results for :func:`run_gloo_ranks` and leave the group together."""
    import os

    import torch.distributed as dist

    torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def run_gloo_ranks(worker, world: int, outdir: str, hang_bound_s: float) -> list:
    """Run ``worker(rank, store_port, outdir)`` on ``world`` spawned processes (the
    TCPStore's master is here); every one must exit 0 within ``hang_bound_s`` (those
    still alive are killed by pid). Returns each rank's saved results."""
    import os

    import torch.distributed as dist
    import torch.multiprocessing as mp

    from elasticep.utils.procs import kill_pids

    store = dist.TCPStore("127.0.0.1", 0, world_size=world + 1, is_master=True,
                          wait_for_workers=False)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, store.port, outdir), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(hang_bound_s)
        codes = [p.exitcode for p in procs]
    finally:
        kill_pids([p.pid for p in procs if p.is_alive()])
    assert codes == [0] * world, f"worker exit codes {codes}"
    return [torch.load(os.path.join(outdir, f"rank{r}.pt")) for r in range(world)]
