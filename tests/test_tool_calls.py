"""Tool calls on /v1/chat/completions: the Qwen3 and DeepSeek-V3 parsers on given text,
whole and streamed; and a round trip with the real `openai` client against the real HTTP
server, whose one rank is a scripted engine (the demo model never writes a tool call by
itself), on the demo model with a Qwen3-style chat template."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from _frontend_live import engine_server, rank_server

from elasticep.engine.request import GenerateRequest, TokenOutput
from elasticep.frontend.tool_parsers import make_parser, parser_for_family
from elasticep_testkit.chat_templates import demo_with_chat_template
from elasticep_testkit.ep import tokenizer
from elasticep_testkit.serving.running_table import RunningTable

pytestmark = pytest.mark.timeout(60)

QWEN_CALLS = ('I will look it up.\n<tool_call>\n{"name": "get_weather", "arguments": '
              '{"city": "Paris", "unit": "C"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
              '"arguments": {}}\n</tool_call>')
DEEPSEEK_V3 = ("Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
               'get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>\n'
               "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```"
               "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
DEEPSEEK_V31 = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>'
                '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>')


def _streamed(name: str, text: str, step: int) -> tuple[str, list]:
    """``text`` pushed ``step`` characters at a time: (content, calls)."""
    parser = make_parser(name)
    content, calls = "", []
    for i in range(0, len(text), step):
        c, k = parser.push(text[i:i + step])
        content, calls = content + c, calls + k
    c, k = parser.finish()
    return content + c, calls + k


@pytest.mark.parametrize("name, text, content, calls", [
    ("qwen3", QWEN_CALLS, "I will look it up.\n",
     [("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {})]),
    ("deepseekv3", DEEPSEEK_V3, "Checking.",
     [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("deepseekv3", DEEPSEEK_V31, "", [("get_weather", {"city": "Paris"})]),
    # no call: the text is content, a lone "<" included
    ("qwen3", "2 < 3, and <tool is a word", "2 < 3, and <tool is a word", []),
    # a block that is not a call (bad JSON), or never closes, is the model's text
    ("qwen3", "a <tool_call>{not json}</tool_call> b", "a <tool_call>{not json}</tool_call> b",
     []),
    ("qwen3", 'x <tool_call>{"name": "f"', 'x <tool_call>{"name": "f"', []),
])
def test_parsers_split_content_and_calls_whole_and_streamed(name, text, content, calls):
    for got_content, got_calls in (make_parser(name).parse(text), _streamed(name, text, 1),
                                   _streamed(name, text, 7)):
        assert got_content == content
        assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
        assert len({c.id for c in got_calls}) == len(calls)


def test_each_family_gets_its_templates_parser():
    assert [parser_for_family(f) for f in ("qwen3_moe", "qwen2_moe", "deepseek_v3",
                                            "deepseek_v2", "mixtral")] == [
        "qwen3", "qwen3", "deepseekv3", "deepseekv3", None]
    with pytest.raises(ValueError, match="known: deepseekv3, qwen25, qwen3"):
        make_parser("hermes2")


class ScriptedEngine(RunningTable):
    """A rank that answers each request with a fixed text (its tokens, one per step,
    then EOS): a tool call, or the final answer once the prompt holds a tool response.
    Keeps the prompts it got, decoded."""

    CALL = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call>")
    ANSWER = "It is 21 degrees in Paris."

    def __init__(self) -> None:
        self.prompts: list[str] = []
        self.running: dict[str, tuple[list[int], int]] = {}

    def add_request(self, req: GenerateRequest) -> None:
        prompt = tokenizer().decode(req.prompt_token_ids)
        self.prompts.append(prompt)
        text = self.ANSWER if "<tool_response>" in prompt else self.CALL
        self.running[req.request_id] = (tokenizer().encode(text) + [0], 0)

    def step(self) -> list[TokenOutput]:
        outs = []
        for rid, (ids, i) in list(self.running.items()):
            done = i + 1 == len(ids)
            outs.append(TokenOutput(rid, i, ids[i], "stop" if done else None))
            self.running[rid] = (ids, i + 1)
            if done:
                del self.running[rid]
        return outs


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    # a bounded name: the demo model, forced into a free string, would run to max_tokens
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,11}$"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False,
                                       "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = demo_with_chat_template(tmp_path_factory.mktemp("m") / "tiny-tools")
    engine = ScriptedEngine()
    with rank_server(model, engine, "tiny", idle_poll_s=0.02) as (server, _):
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0), engine


def test_round_trip_with_the_openai_client(served):
    """The model's call comes back as ``tool_calls``; sent back with the tool's result,
    both reach the chat template, and the model's answer is plain content."""
    client, engine = served
    first = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER])
    (choice,) = first.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert (call.type, call.function.name) == ("function", "get_weather")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id.startswith("call_")
    assert "# Tools" in engine.prompts[-1] and json.dumps(WEATHER["function"]["name"]) in \
        engine.prompts[-1]
    follow_up = [*ASK, choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    second = client.chat.completions.create(model="tiny", messages=follow_up, tools=[WEATHER])
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.content == ScriptedEngine.ANSWER
    assert not second.choices[0].message.tool_calls
    prompt = engine.prompts[-1]
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call>") in prompt
    assert '<tool_response>\n{"temp": 21}\n</tool_response>' in prompt


def test_streamed_calls_arrive_as_deltas(served):
    client, _ = served
    chunks = list(client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER],
                                                 stream=True))
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == [
        (0, "get_weather", {"city": "Paris"})]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    assert [c.choices[0].finish_reason for c in chunks][-1] == "tool_calls"
    assert chunks[0].choices[0].delta.role == "assistant"


def test_tool_choice_none_and_bad_choices(served):
    """``none``: the template is not told of the tools and nothing is parsed; a named
    function that is not offered, or a forced call plus a response format, is a 400
    naming the field."""
    client, engine = served
    plain = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER],
                                           tool_choice="none")
    assert "# Tools" not in engine.prompts[-1]
    assert plain.choices[0].message.content == ScriptedEngine.CALL
    assert plain.choices[0].finish_reason == "stop" and not plain.choices[0].message.tool_calls
    for extra in ({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
                  {"tool_choice": "required", "response_format": {"type": "json_object"}}):
        with pytest.raises(openai.BadRequestError, match="tool_choice") as err:
            client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER],
                                           **extra)
        assert err.value.body["param"] == "tool_choice"
    # a forced call with no tools, and two tools of one name
    with pytest.raises(openai.BadRequestError, match="needs tools") as err:
        client.chat.completions.create(model="tiny", messages=ASK, tool_choice="required")
    assert err.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError, match="two functions are named") as err:
        client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, WEATHER])
    assert err.value.body["param"] == "tools"


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """The real demo model (one in-process engine rank) with the Qwen3-style template."""
    model = demo_with_chat_template(tmp_path_factory.mktemp("m") / "tiny-real-tools")
    with engine_server(model, "tiny") as (server, *_):
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_a_forced_call_from_the_real_model_round_trips(real):
    """``tool_choice`` "required" and a named function make the demo model itself write
    a call (the grammar forces the format, the name and arguments that follow the
    function's schema); its answer to the tool's result is plain text."""
    tools = [WEATHER, TIME]
    first = real.chat.completions.create(model="tiny", messages=ASK, tools=tools,
                                         tool_choice="required", max_tokens=160)
    (choice,) = first.choices
    assert choice.finish_reason == "tool_calls", choice.message
    (call,) = choice.message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    named = {"type": "function", "function": {"name": "get_weather"}}
    chunks = list(real.chat.completions.create(model="tiny", messages=ASK, tools=tools,
                                               tool_choice=named, max_tokens=160, stream=True))
    (delta,) = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert delta.function.name == "get_weather" and chunks[-1].choices[0].finish_reason == \
        "tool_calls"
    jsonschema.validate(json.loads(delta.function.arguments), WEATHER["function"]["parameters"])
    follow_up = [*ASK, choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "21 degrees"}]
    answer = real.chat.completions.create(model="tiny", messages=follow_up, tools=tools,
                                          max_tokens=8)
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
