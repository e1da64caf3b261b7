"""Tool-call parsers: a model's text -> content plus OpenAI ``tool_calls``, whole or as it
streams.

The formats are the ones the families' chat templates teach their models:

* ``qwen3`` (Qwen2/Qwen3 MoE, Hermes style)::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

* ``deepseekv3`` (DeepSeek-V2/V3/R1; SGLang's name)::

      <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
      ```json
      {"city": "Paris"}
      ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

  and V3.1's shorter call, ``<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``.

``tool_choice`` "required" or a named function is forced rather than hoped for: the
request gets a grammar (:func:`forced_call_grammar`) that admits exactly one call block
of the format, to one of the offered functions, with arguments that follow its JSON
schema.

A streaming parser releases text as content until a block's opening tag could be
starting, holds it back until the block closes, then releases the whole call as one
delta (OpenAI's stream allows a call's name and arguments in one chunk). A block that
never closes, or whose JSON does not parse, is content after all, as vLLM's parsers
return it: the client sees what the model wrote.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from elasticep.engine.request import GrammarSpec

__all__ = ["TOOL_CALL_PARSERS", "ToolCall", "ToolCallParser", "forced_call_grammar",
           "make_parser", "parser_for_family"]


@dataclass(frozen=True)
class ToolCall:
    """One parsed call.

    Attributes:
        name: the function's name.
        arguments: its arguments as a JSON object's text (OpenAI sends a string).
        id: ``call_<hex>``, fresh per call.
    """

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass(frozen=True)
class _Format:
    """Where a format's blocks begin and end, and how one block's inside reads."""

    begin: str  # opens a block
    end: str  # closes it
    # the begin/end of the whole section of calls, stripped around the blocks
    section: tuple[str, str] = ("", "")


QWEN3 = _Format("<tool_call>", "</tool_call>")
DEEPSEEK_V3 = _Format("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                      ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"))
_DEEPSEEK_FENCED = re.compile(r"^(?:function)?<｜tool▁sep｜>(?P<name>[^\n]+)\n```(?:json)?\n"
                              r"(?P<args>.*)\n```$", re.S)
_DEEPSEEK_PLAIN = re.compile(r"^(?P<name>[^<\n]+)<｜tool▁sep｜>(?P<args>.*)$", re.S)


def _qwen3_call(inside: str) -> ToolCall | None:
    try:
        obj = json.loads(inside)
    except json.JSONDecodeError:
        return None
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(
        args, ensure_ascii=False))


def _deepseek_call(inside: str) -> ToolCall | None:
    m = _DEEPSEEK_FENCED.match(inside.strip()) or _DEEPSEEK_PLAIN.match(inside.strip())
    if m is None:
        return None
    try:
        args = json.loads(m["args"])
    except json.JSONDecodeError:
        return None
    return ToolCall(m["name"].strip(), json.dumps(args, ensure_ascii=False))


_PARSE_BLOCK = {QWEN3: _qwen3_call, DEEPSEEK_V3: _deepseek_call}
# --tool-call-parser names (SGLang's), and the families whose templates use each
TOOL_CALL_PARSERS = {"qwen3": QWEN3, "qwen25": QWEN3, "deepseekv3": DEEPSEEK_V3}
_FAMILY_PARSER = {"qwen3_moe": "qwen3", "qwen2_moe": "qwen3", "deepseek_v2": "deepseekv3",
                  "deepseek_v3": "deepseekv3"}


def parser_for_family(model_type: str) -> str | None:
    """The parser name a family's chat template implies (pure); None: none known."""
    return _FAMILY_PARSER.get(model_type)


def make_parser(name: str) -> ToolCallParser:
    """A fresh parser of the format ``name`` (a key of :data:`TOOL_CALL_PARSERS`).

    Raises:
        ValueError: an unknown name, listing the known ones.
    """
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r} (known: "
                         f"{', '.join(sorted(TOOL_CALL_PARSERS))})")
    return ToolCallParser(TOOL_CALL_PARSERS[name])


class ToolCallParser:
    """Splits one completion's text into content and calls, as it streams or at once.

    Args:
        fmt: the model's tool-call format.
    """

    def __init__(self, fmt: _Format) -> None:
        self.fmt = fmt
        self._parse_block = _PARSE_BLOCK[fmt]
        self._pending = ""  # text held back: a possible or open block
        self.calls: list[ToolCall] = []  # every call released so far

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The whole text at once: (content, calls); content keeps what is not a call."""
        content, calls = self.push(text)
        more, last = self.finish()
        return content + more, calls + last

    def push(self, delta: str) -> tuple[str, list[ToolCall]]:
        """Add streamed text; returns (content safe to show now, calls completed now)."""
        self._pending += delta
        content: list[str] = []
        calls: list[ToolCall] = []
        while self._pending:
            start = self._pending.find(self.fmt.begin)
            if start < 0:  # no block: release all but a possible tag's beginning
                keep = _partial_tag_len(self._pending, self._tags())
                content.append(self._strip_section(self._pending[:len(self._pending) - keep]))
                self._pending = self._pending[len(self._pending) - keep:]
                break
            content.append(self._strip_section(self._pending[:start]))
            end = self._pending.find(self.fmt.end, start + len(self.fmt.begin))
            if end < 0:  # an open block: wait for its end
                self._pending = self._pending[start:]
                break
            block = self._pending[start:end + len(self.fmt.end)]
            call = self._parse_block(block[len(self.fmt.begin):-len(self.fmt.end)])
            if call is None:
                content.append(block)  # not a call after all: the model's text
            else:
                calls.append(call)
                self.calls.append(call)
            self._pending = self._pending[end + len(self.fmt.end):]
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The end of the text: what is still held back is content (an unclosed block)."""
        rest, self._pending = self._pending, ""
        if rest.startswith(self.fmt.begin):
            return rest, []
        return self._strip_section(rest), []

    def _tags(self) -> tuple[str, ...]:
        return tuple(t for t in (self.fmt.begin, *self.fmt.section) if t)

    def _strip_section(self, text: str) -> str:
        """Drop the section markers around the blocks, and the whitespace between
        blocks that a calling model writes (content then is only the prose)."""
        for tag in self.fmt.section:
            if tag:
                text = text.replace(tag, "")
        return "" if self.calls and not text.strip() else text


def _partial_tag_len(text: str, tags: tuple[str, ...]) -> int:
    """The length of the longest suffix of ``text`` that begins one of ``tags`` (pure)."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


def _call_parts(fmt: _Format, name: str, parameters: Mapping[str, Any] | None,
                ) -> tuple[str, dict[str, Any], str]:
    """(text before the JSON, its schema, text after) of one call to ``name`` (pure)."""
    args = dict(parameters) if parameters else {"type": "object"}
    if fmt is QWEN3:
        body = {"type": "object", "additionalProperties": False,
                "required": ["name", "arguments"],
                "properties": {"name": {"const": name}, "arguments": args}}
        return f"{fmt.begin}\n", body, f"\n{fmt.end}"
    begin, end = fmt.section
    return (f"{begin}{fmt.begin}function<｜tool▁sep｜>{name}\n```json\n", args,
            f"\n```{fmt.end}{end}")


def forced_call_grammar(parser: str, tools: Sequence[Mapping[str, Any]]) -> GrammarSpec:
    """The grammar of exactly one call, in ``parser``'s format, to one of ``tools``
    (OpenAI's tool definitions: ``{"type": "function", "function": {"name",
    "parameters"}}``), as EBNF.

    Raises:
        ValueError: an unknown parser, no tools, or a parameters schema xgrammar cannot
            take (its reason).
    """
    import xgrammar as xgr

    if parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"unknown tool-call parser {parser!r}")
    if not tools:
        raise ValueError("no tools to call")
    fmt = TOOL_CALL_PARSERS[parser]
    calls = []
    for tool in tools:
        fn = tool["function"]
        before, schema, after = _call_parts(fmt, fn["name"], fn.get("parameters"))
        try:
            body = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
        except RuntimeError as exc:
            raise ValueError(f"function {fn['name']!r}: parameters: "
                             f"{str(exc).strip().rsplit(': ', 1)[-1]}") from None
        calls.append(xgr.Grammar.concat(_literal(before), body, _literal(after)))
    return GrammarSpec("ebnf", str(calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls)))


def _literal(text: str) -> Any:
    """The xgrammar ``Grammar`` of exactly ``text``."""
    import xgrammar as xgr

    return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text, ensure_ascii=False)}")
