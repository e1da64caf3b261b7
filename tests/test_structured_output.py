"""Structured output (xgrammar): the grammar's token mask on the sampler's logits, on the
demo model in-process: JSON-schema outputs parse and validate, regex and EBNF outputs
match, a resumed request replays its tokens into the grammar and continues exactly; and
the API fields (``response_format``, ``regex``, SGLang's ``sampling_params.json_schema``)
through the real server and the openai client."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
import torch
from _frontend_live import engine_server

from elasticep.engine.grammar import Grammars, check_grammar
from elasticep.engine.llm_engine import EngineConfig, LLMEngine
from elasticep.engine.request import GenerateRequest, GrammarSpec, SamplingParams
from elasticep_testkit.ep import prompts, tokenizer
from elasticep_testkit.paths import DEMO_MODEL
from elasticep_testkit.torch_threads import one_torch_thread

pytestmark = pytest.mark.timeout(120)

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
          "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"}}}
JSON = GrammarSpec("json_schema", json.dumps(SCHEMA))
EOS = 0


@pytest.fixture(scope="module")
def engine():
    with one_torch_thread():
        yield LLMEngine.from_pretrained(DEMO_MODEL, progress=False,
                                        config=EngineConfig(max_total_tokens=2048))


def run(engine: LLMEngine, rid: str, prompt, params: SamplingParams, resumed=()) -> list[int]:
    """One request to its end; the tokens it generated after ``resumed``."""
    engine.add_request(GenerateRequest(rid, tuple(prompt), params, tuple(resumed)))
    out = []
    while engine.has_unfinished():
        out += [o.token_id for o in engine.step() if o.request_id == rid]
    return out


def text(ids: list[int]) -> str:
    return tokenizer().decode(ids[:-1] if ids and ids[-1] == EOS else ids)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_json_schema_outputs_parse_and_validate(engine, temperature):
    params = SamplingParams(max_tokens=48, temperature=temperature, seed=7, grammar=JSON)
    outs = engine.generate([list(p) for p in prompts()[:4]], params)
    for ids in outs:
        assert ids[-1] == EOS, text(ids)  # the grammar completed, then ended the request
        jsonschema.validate(json.loads(text(ids)), SCHEMA)
    if temperature:
        assert len({text(o) for o in outs}) > 1  # drawn, not one forced string


def test_regex_ebnf_and_json_object(engine):
    ids = [list(p) for p in prompts()[:3]]
    for out in engine.generate(ids, SamplingParams(max_tokens=16, grammar=GrammarSpec(
            "regex", r"(yes|no), [0-9]{1,3}"))):
        assert re.fullmatch(r"(yes|no), [0-9]{1,3}", text(out)), text(out)
    ebnf = 'root ::= "Answer: " ("A" | "B" | "C") "."'
    for out in engine.generate(ids, SamplingParams(max_tokens=16, temperature=1.0, seed=3,
                                                   grammar=GrammarSpec("ebnf", ebnf))):
        assert re.fullmatch(r"Answer: [ABC]\.", text(out)), text(out)
    # ignore_eos cannot run a request past its complete grammar
    (out,) = engine.generate(ids[:1], SamplingParams(max_tokens=16, ignore_eos=True,
                                                     grammar=GrammarSpec("ebnf", ebnf)))
    assert out[-1] == EOS and re.fullmatch(r"Answer: [ABC]\.", text(out))
    (out,) = engine.generate(ids[:1], SamplingParams(max_tokens=6,
                                                     grammar=GrammarSpec("json_object")))
    assert text(out).startswith('{"')  # any object; the demo model writes a long key


def test_a_resumed_request_continues_its_grammar(engine):
    """What a survivor does with a dead rank's request: prompt + generated tokens, the
    tokens replayed into a fresh matcher; the continuation equals the fault-free one
    (seeded sampling, keyed by request id and token index)."""
    prompt = list(prompts()[5])
    params = SamplingParams(max_tokens=48, temperature=0.9, seed=11, grammar=JSON)
    full = run(engine, "resume-me", prompt, params)
    jsonschema.validate(json.loads(text(full)), SCHEMA)
    for k in (1, 5, len(full) // 2):
        assert run(engine, "resume-me", prompt, params, resumed=full[:k]) == full[k:], k


def test_masking_changes_no_state_and_foreign_tokens_are_refused(engine):
    g = engine.grammars
    g.add("probe", JSON)
    try:
        logits = torch.randn(2, engine.model.config.vocab_size)
        once, twice = logits.clone(), logits.clone()
        g.mask(once, ["free", "probe"])
        g.mask(twice, ["free", "probe"])  # a redone step masks the same way
        assert torch.equal(once, twice) and torch.equal(once[0], logits[0])
        allowed = torch.isfinite(once[1]).nonzero().flatten().tolist()
        assert allowed and all(tokenizer().decode([t]).startswith("{") for t in allowed)
    finally:
        g.drop("probe")
    with pytest.raises(ValueError, match="resumed token 0 .* does not follow its json_schema"):
        Grammars(lambda: engine.grammars._get_compiler()).add(
            "x", JSON, tokenizer().encode("hello"))
    with pytest.raises(ValueError, match="no grammar backend"):
        Grammars().add("x", JSON)
    with pytest.raises(ValueError, match="invalid regex: .*parenthesis"):
        check_grammar(GrammarSpec("regex", "a("))


@pytest.fixture(scope="module")
def live():
    with engine_server(DEMO_MODEL, "tiny") as (server, *_):
        yield (openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0),
               httpx.Client(base_url=server.url, timeout=30))


def test_response_format_and_extensions_through_the_api(live):
    client, http = live
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    for stream in (False, True):
        res = client.completions.create(model="tiny", prompt="Tom is", max_tokens=48,
                                        temperature=0.9, seed=5, stream=stream,
                                        extra_body={"response_format": fmt})
        out = "".join(c.choices[0].text for c in res) if stream else res.choices[0].text
        jsonschema.validate(json.loads(out), SCHEMA)
    res = client.completions.create(model="tiny", prompt="Is it?", max_tokens=8,
                                    extra_body={"regex": "(yes|no)!"})
    assert res.choices[0].text in ("yes!", "no!") and res.choices[0].finish_reason == "stop"
    sgl = http.post("/generate", json={"text": "Tom is", "sampling_params": {
        "max_new_tokens": 48, "json_schema": json.dumps(SCHEMA)}}).json()
    jsonschema.validate(json.loads(sgl["text"]), SCHEMA)
    bad = http.post("/v1/completions", json={"model": "tiny", "prompt": "a", "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"
    assert "objec" in bad.json()["error"]["message"]
    two = http.post("/v1/completions", json={"model": "tiny", "prompt": "a", "regex": "a",
                                             "ebnf": 'root ::= "a"'})
    assert two.status_code == 400 and two.json()["error"]["param"] == "ebnf"
