"""``from elasticep import LLM, SamplingParams``: the offline API on a real EP2 deployment
of the demo model, through a rank kill; its outputs' shape, chat, and a clean shutdown.
One deployment for the module (about 20 s to start on 2 cores)."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import jsonschema
import pytest
from _ckpt_copy import checkpoint_without

from elasticep.config import DeploymentConfig
from elasticep.engine.request import GrammarSpec
from elasticep.entrypoints.llm import deployment_settings
from elasticep.entrypoints.validate import UsageError
from elasticep.utils.procs import pid_alive
from elasticep_testkit.chat_templates import QWEN3_STYLE
from elasticep_testkit.ep import (
    GREEDY,
    assert_matches_reference,
    prompts,
    reference_for,
    tokenizer,
)
from elasticep_testkit.paths import DEMO_MODEL

pytestmark = pytest.mark.timeout(150)

N = 4  # prompts through the kill (and as many JSON-schema requests)
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from elasticep import LLM

    # rank 1 SIGKILLs itself at the 6th working step: mid-stream for every prompt
    engine = LLM(model=str(DEMO_MODEL), ep_size=2, fault="kill:rank=1:step=6",
                 log_dir=str(tmp_path_factory.mktemp("llm-logs")), heartbeat_timeout=10.0)
    yield engine
    engine.shutdown()


def test_generate_returns_every_output_through_a_rank_kill(llm):
    """Every prompt's greedy tokens equal the ep_size=1 reference (near-tie rule), with
    vLLM's output shape, although rank 1 died under the call; and JSON-schema requests in
    the same batch, some resumed on rank 0 mid-object (their tokens replayed into the
    grammar there), all end in JSON that validates."""
    from elasticep import SamplingParams

    ids = prompts()[:N]
    texts = [tokenizer().decode(p) for p in ids]
    assert [list(tokenizer()(t).input_ids) for t in texts] == [list(p) for p in ids]
    greedy = SamplingParams(max_tokens=GREEDY.max_tokens, ignore_eos=True)
    schema = SamplingParams(max_tokens=48, temperature=0.9, seed=3,
                            grammar=GrammarSpec("json_schema", json.dumps(SCHEMA)))
    outs = llm.generate(texts + texts, [greedy] * N + [schema] * N, use_tqdm=False)
    assert llm._running().frontend.tracker.resubmitted_total >= N // 2  # rank 1's half
    outs, constrained = outs[:N], outs[N:]
    assert [o.prompt for o in outs] == texts
    assert [o.prompt_token_ids for o in outs] == [list(p) for p in ids]
    got = [o.outputs[0].token_ids for o in outs]
    ref = reference_for(str(DEMO_MODEL), ids)
    assert_matches_reference(got, "LLM.generate EP2, rank 1 killed at step 6", ref)
    for o in outs:
        (c,) = o.outputs
        assert (c.index, c.finish_reason, c.logprobs, o.finished) == (0, "length", None, True)
        assert c.text == tokenizer().decode(c.token_ids, skip_special_tokens=True)
    for o in constrained:
        assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    status = llm.deployment.status()
    assert [(r.rank, r.state.value) for r in status.ranks] == [(0, "healthy"), (1, "failed")]


def test_prompt_forms_and_per_prompt_params(llm):
    """Token ids, vLLM's dict prompts and one SamplingParams per prompt."""
    from elasticep import SamplingParams

    ids = list(prompts()[0])
    outs = llm.generate([ids, {"prompt_token_ids": ids}, {"prompt": "The cat"}],
                        [SamplingParams(max_tokens=3, ignore_eos=True),
                         SamplingParams(max_tokens=5, ignore_eos=True),
                         SamplingParams(max_tokens=2, ignore_eos=True)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5, 2]
    assert outs[1].outputs[0].token_ids[:3] == outs[0].outputs[0].token_ids  # greedy
    assert (outs[0].prompt, outs[2].prompt) == (None, "The cat")
    one = llm.generate(ids, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert one[0].outputs[0].token_ids == outs[0].outputs[0].token_ids  # one id list: one prompt
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate(["a"], [SamplingParams(), SamplingParams()], use_tqdm=False)
    with pytest.raises(ValueError, match="top_p"):
        llm.generate(["a"], SamplingParams(top_p=0.0), use_tqdm=False)


def test_logprobs_in_vllm_shape_match_the_engine(llm):
    """``logprobs`` / ``prompt_logprobs`` come back as vLLM's per-position dicts, equal
    (within float32 rounding over a different batch) to the log-softmax of the
    in-process engine's logits at the same positions."""
    import torch

    from elasticep import SamplingParams
    from elasticep.engine.llm_engine import LLMEngine

    ids = list(prompts()[1])
    out = llm.generate([ids], SamplingParams(max_tokens=4, ignore_eos=True, logprobs=2,
                                             prompt_logprobs=1), use_tqdm=False)[0]
    gen = out.outputs[0]
    ref = torch.log_softmax(LLMEngine.from_pretrained(DEMO_MODEL, progress=False).prompt_logits(
        ids + gen.token_ids[:-1]).float(), -1)
    assert len(gen.logprobs) == 4 and out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(ids)
    for j, (tok, lp) in enumerate(zip(gen.token_ids, gen.logprobs, strict=True)):
        assert 2 <= len(lp) <= 3 and tok in lp  # the token and its 2 alternatives
        for t, v in lp.items():
            assert abs(v - float(ref[len(ids) - 1 + j, t])) < 1e-3
    assert gen.cumulative_logprob == pytest.approx(sum(lp[t] for t, lp in
                                                       zip(gen.token_ids, gen.logprobs, strict=True)))
    for pos in (1, len(ids) - 1):
        assert abs(out.prompt_logprobs[pos][ids[pos]] - float(ref[pos - 1, ids[pos]])) < 1e-3


def test_an_interrupted_batch_ends_its_requests_and_the_next_batch_runs(llm):
    """Ctrl-C in the middle of a batch (a KeyboardInterrupt out of the driver's loop, here
    raised at the first token) used to leave every request of it pending on the loop:
    still running on the ranks, and at exit one "Event loop is closed" traceback each."""
    from elasticep import SamplingParams

    driver = llm._running()
    ids = [list(p) for p in prompts()[:N]]

    fired = []

    def interrupt(_i, _event):  # one Ctrl-C
        if not fired:
            fired.append(True)
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        driver.generate(ids, SamplingParams(max_tokens=64, ignore_eos=True), on_event=interrupt)
    assert driver.frontend.tracker.num_running == 0
    outs = llm.generate(ids[:1], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 3


def test_chat_renders_the_template_and_answers(llm):
    from elasticep import SamplingParams

    conversation = [{"role": "user", "content": "How many legs does a cat have?"}]
    with pytest.raises(ValueError, match="no chat template"):  # the demo model has none
        llm.chat(conversation)
    (out,) = llm.chat(conversation, SamplingParams(max_tokens=4, ignore_eos=True),
                      chat_template=QWEN3_STYLE, use_tqdm=False)
    assert out.prompt == ("<|im_start|>user\nHow many legs does a cat have?<|im_end|>\n"
                          "<|im_start|>assistant\n")
    assert out.prompt_token_ids == tokenizer().encode(out.prompt, add_special_tokens=False)
    (same,) = llm.generate(out.prompt_token_ids, SamplingParams(max_tokens=4, ignore_eos=True),
                           use_tqdm=False)
    assert out.outputs[0].token_ids == same.outputs[0].token_ids


def test_shutdown_stops_every_process_it_started(llm):
    dep = llm.deployment
    pids = [*dep.pids().values(), dep.coordinator.pid]
    assert pid_alive(pids[0])
    llm.shutdown()
    llm.shutdown()  # idempotent
    assert not any(pid_alive(p) for p in pids)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(["a"])


def test_settings_take_flag_names_and_default_the_capacity():
    cfg = deployment_settings("/m", {"ep_size": 2, "heartbeat_timeout": 3.0,
                                     "gc_warning_threshold_secs": 0.5})
    assert (cfg.ep_size, cfg.max_ep_size, cfg.heartbeat_timeout_s) == (2, 2, 3.0)
    assert cfg.gc_warning_threshold_s == 0.5  # SGLang's keyword
    assert DeploymentConfig(model="/m", ep_size=3).max_ep_size == 3  # no reserve unless asked
    assert DeploymentConfig(model="/m", ep_size=2, max_ep_size=4).max_ep_size == 4
    with pytest.raises(TypeError, match="'ep_sise'"):
        deployment_settings("/m", {"ep_sise": 2})
    # a bool passed the range check here and killed every rank, whose config decoder
    # wants a float; a string failed with "'<=' not supported between ..."
    with pytest.raises(TypeError) as err:
        deployment_settings("/m", {"gc_warning_threshold_secs": True})
    assert str(err.value) == "LLM() keyword gc_warning_threshold_secs: expected float, got true"
    with pytest.raises(TypeError, match='^LLM\\(\\) keyword heartbeat_timeout: expected float, got "2"$'):
        deployment_settings("/m", {"heartbeat_timeout": "2"})
    with pytest.raises(ValueError, match="--max-ep-size"):
        deployment_settings("/m", {"ep_size": 2, "max_ep_size": 1})


def test_a_config_only_directory_is_refused_before_anything_starts(tmp_path):
    from elasticep import LLM

    (tmp_path / "config.json").write_text((DEMO_MODEL / "config.json").read_text())
    with pytest.raises(UsageError, match="--load-format dummy"):
        LLM(model=str(tmp_path))


def test_a_rank_dying_while_loading_raises_one_line(tmp_path, caplog):
    """LLM's ranks log to a temporary directory named in one log line; a rank that dies
    while loading raises a RuntimeError of one line: the rank, its exception and the log
    file that holds the traceback."""
    from elasticep import LLM

    key = "model.layers.0.self_attn.o_proj.weight"
    ckpt = checkpoint_without(DEMO_MODEL, tmp_path / "ckpt", key)
    with caplog.at_level(logging.INFO, logger="elasticep.entrypoints.batch_driver"), \
            pytest.raises(RuntimeError) as raised:
        LLM(model=str(ckpt), ep_size=2)
    named = [r.getMessage() for r in caplog.records if r.name.endswith("batch_driver")]
    assert len(named) == 1 and named[0].startswith("worker logs in "), named
    log_dir = named[0].removeprefix("worker logs in ")
    found = re.fullmatch(r"rank (\d) exited with 1 while loading: (ValueError: .*) "
                         rf"\(traceback in rank\d\.log in {re.escape(log_dir)}\)",
                         str(raised.value))
    assert found and key in found[2], str(raised.value)
    log = (Path(log_dir) / f"rank{found[1]}.log").read_text()
    shutil.rmtree(log_dir)  # made for this test
    assert "Traceback (most recent call last)" in log and found[2] in log


@pytest.mark.parametrize("bad", ["file", ""])
def test_a_bad_log_dir_is_refused_before_anything_starts(tmp_path, bad):
    """A log_dir that is a file used to raise FileExistsError from the launcher after the
    coordinator had started; an empty one put the rank logs in the working directory."""
    from elasticep import LLM

    log_dir = str(tmp_path / "f") if bad else ""
    if bad:
        Path(log_dir).write_text("")
    message = (f"--log-dir {log_dir}: cannot create it (File exists)" if bad
               else "--log-dir must not be empty")
    with pytest.raises(UsageError) as err:
        LLM(model=str(DEMO_MODEL), ep_size=2, log_dir=log_dir)
    assert str(err.value) == message
