"""Tool calls on ``/v1/chat/completions``: which parser a request gets, the grammar that
forces a call, and the calls' place in a reply (whole message or stream delta).

The parsing itself is :mod:`elasticep.frontend.tool_parsers`; the models are
:mod:`elasticep.frontend.openai_tools`.
"""

from __future__ import annotations

from dataclasses import replace

from elasticep.engine.request import GrammarSpec, SamplingParams
from elasticep.frontend.api_errors import OpenAIError
from elasticep.frontend.openai_protocol import ChatCompletionRequest
from elasticep.frontend.openai_responses import ChatDelta
from elasticep.frontend.openai_tools import FunctionCall, NamedToolChoice, ToolCallOut
from elasticep.frontend.tool_parsers import (
    ToolCall,
    ToolCallParser,
    forced_call_grammar,
    make_parser,
)


def tool_parser(req: ChatCompletionRequest, parser: str | None,
                model_name: str) -> ToolCallParser | None:
    """A fresh parser when the request lets the model call tools, else None.

    Args:
        req: the chat request.
        parser: the served model's tool-call format (``--tool-call-parser``), or None.
        model_name: the served name, for the error.

    Raises:
        OpenAIError: 400 for tools on a model without a tool-call format.
    """
    if req.tools_for_template() is None:
        return None
    if parser is None:
        raise OpenAIError(400, f"The model `{model_name}` has no known tool-call format "
                          "(serve --tool-call-parser names one)", param="tools")
    return make_parser(parser)


def with_forced_call(req: ChatCompletionRequest, parser: str | None,
                     params: SamplingParams) -> SamplingParams:
    """``params`` with the grammar of one call where ``tool_choice`` is "required" (any
    of the tools) or names a function (that one); ``params`` unchanged otherwise.

    Raises:
        OpenAIError: 400 naming the field: two tools of one name, a forced call with no
            tools, a named function that is not among ``tools``,
            a forced call beside a structured-output constraint, or parameters whose
            schema the grammar library refuses.
    """
    choice = req.tool_choice
    names = [t.function.name for t in req.tools or ()]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise OpenAIError(400, f"tools: two functions are named {dup!r}", param="tools")
    if not names and (choice == "required" or isinstance(choice, NamedToolChoice)):
        raise OpenAIError(400, f"tool_choice={choice!r} needs tools", param="tool_choice")
    tools = req.tools_for_template()
    if tools is None or choice in (None, "auto") or parser is None:
        return params
    if isinstance(choice, NamedToolChoice):
        name = choice.function.get("name")
        tools = [t for t in tools if t["function"]["name"] == name]
        if not tools:
            raise OpenAIError(400, f"tool_choice names function {name!r}, which is not "
                              "among tools", param="tool_choice")
    if params.grammar is not None:
        raise OpenAIError(400, f"tool_choice={choice!r} forces a tool call, which leaves no "
                          "room for a structured-output constraint", param="tool_choice")
    try:
        grammar: GrammarSpec = forced_call_grammar(parser, tools)
    except ValueError as exc:
        raise OpenAIError(400, f"tools: {exc}", param="tools") from None
    return replace(params, grammar=grammar)


def finish_reason(reason: str | None, parser: ToolCallParser | None) -> str | None:
    """OpenAI's "tool_calls" where a completion that stopped by itself called tools."""
    if reason == "stop" and parser is not None and parser.calls:
        return "tool_calls"
    return reason


def call_deltas(calls: list[ToolCall], parser: ToolCallParser) -> list[ToolCallOut]:
    """Stream deltas of ``calls``, the ones just completed, indexed by their place among
    all of the choice's calls."""
    first = len(parser.calls) - len(calls)
    return [ToolCallOut(index=first + i, id=c.id,
                        function=FunctionCall(name=c.name, arguments=c.arguments))
            for i, c in enumerate(calls)]


def reply_message(text: str, parser: ToolCallParser | None) -> ChatDelta:
    """The assistant message of a whole completion: its text, or (with a parser) the
    prose as content (None when only calls were written) and the calls."""
    if parser is None:
        return ChatDelta(role="assistant", content=text)
    content, calls = parser.parse(text)
    return ChatDelta(role="assistant", content=content or None, tool_calls=[
        ToolCallOut(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
        for c in calls])
