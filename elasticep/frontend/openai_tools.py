"""The request and response models of tool calls and response formats on the OpenAI
endpoints (OpenAI's shapes): what ``tools``, ``tool_choice``, a message's
``tool_calls``, a reply's ``tool_calls`` and ``response_format`` hold.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class JsonSchemaFormat(_Strict):
    """``response_format.json_schema``: OpenAI's named schema."""

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """``response_format``: free text, any JSON object, or JSON that follows a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionCall(BaseModel):
    """A call's function: its name and its arguments as JSON text (OpenAI's shape)."""

    name: str
    arguments: str


class ToolCallIn(_Strict):
    """A call an earlier assistant turn made (sent back in ``messages``)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    """One entry of ``tools``: a function the model may call."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: dict[str, str]


class ToolCallOut(BaseModel):
    """A call in a response; ``index`` is set in stream deltas (its place among the
    choice's calls)."""

    index: int | None = None
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall
