"""A Responses API request (`POST /v1/responses`) checked field by field and turned into a chat request.

Why a translation: the Responses API is chat with other names. `input` (a string or a list of items),
`instructions`, earlier turns from `previous_response_id`, `max_output_tokens` and flat function `tools`
become chat `messages`, `max_completion_tokens` and chat tools, which `protocol.parse_chat` then checks
and renders with the chat template as `/v1/chat/completions` does; so the same greedy request gets the
same text from both. Items of the input:

- a message (`{"role", "content"}`, `type` "message" or none): content a string or `input_text` /
  `output_text` parts; the role `developer` is the template's `system`;
- `function_call` (`call_id`, `name`, `arguments`): an assistant turn calling a tool;
- `function_call_output` (`call_id`, `output`): the tool's answer, a `tool` message.

`instructions` go first as a system message and are not carried over from a previous response (as
OpenAI does). Which fields are read is `fields.py`'s table, like every endpoint's; any other field that
would change the answer is refused in one sentence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from .protocol import ApiError, check_fields, invalid
from .response_store import ResponseStore

ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


@dataclass
class ResponseRequest:
    """A checked Responses request: the chat body to parse, the conversation it continues and what the
    response object repeats back."""

    chat: dict  # a /v1/chat/completions body
    messages: list  # the conversation before the answer (previous response's included, instructions not)
    stream: bool
    store: bool
    echo: dict  # request fields the response object repeats (instructions, tools, ...)


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") not in ("input_text", "output_text", "text")
                or not isinstance(part.get("text"), str)
            ):
                raise invalid(
                    where, part, 'must be text parts ({"type": "input_text", "text": ...}); this model reads text only'
                )
            out.append(part["text"])
        return "".join(out)
    raise invalid(where, content, "must be a string or a list of text parts")


def _items(value: Any) -> list:
    """`input` as chat messages."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise invalid("input", value, "must be a string or a non-empty list of input items")
    out: list = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(where, item, "must be an object (a message or a function call item)")
        kind = item.get("type", "message")
        if kind == "message":
            role = ROLES.get(item.get("role"))
            if role is None:
                raise invalid(f"{where}.role", item.get("role"), "must be user, system, developer or assistant")
            out.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            name, arguments, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
            if not isinstance(name, str) or not isinstance(arguments, str) or not isinstance(call_id, str):
                raise invalid(where, item, "must carry a call_id, a name and arguments as strings")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)  # parallel calls are one assistant turn
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output, call_id = item.get("output"), item.get("call_id")
            if not isinstance(call_id, str) or not isinstance(output, str):
                raise invalid(where, item, "must carry a call_id and an output as strings")
            out.append({"role": "tool", "tool_call_id": call_id, "content": output})
        else:
            raise invalid(
                f"{where}.type", kind, "is not supported: send messages, function_call and function_call_output items"
            )
    return out


def _tools(value: Any) -> Optional[list]:
    """Responses' flat function tools as chat tools."""
    if value is None or value == []:
        return None
    if not isinstance(value, list):
        raise invalid("tools", value, "must be a list of function tools")
    out = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            raise invalid(f"tools[{i}]", tool, 'is not supported: only {"type": "function", "name": ...} tools')
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def parse_response_request(body: Any, store: ResponseStore) -> ResponseRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    check_fields(body, "responses")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid("instructions", instructions, "must be a string")
    earlier: list = []
    previous = body.get("previous_response_id")
    if previous is not None:
        entry = store.get(previous) if isinstance(previous, str) else None
        if entry is None:
            raise ApiError(
                404,
                f"previous_response_id={previous!r} is not stored here (unknown, not stored, or "
                f"evicted: this server keeps the last {store.size} responses); send the whole "
                f"conversation as input instead.",
                param="previous_response_id",
            )
        earlier = list(entry.messages)
    if "input" not in body:
        raise ApiError(400, "input is required: pass a string or a list of input items.", param="input")
    messages = earlier + _items(body["input"])
    response_format, text_echo = _text_format(body.get("text"))
    tools = _tools(body.get("tools"))
    tool_choice = body.get("tool_choice")
    chat_choice = tool_choice
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and "function" not in tool_choice:
        chat_choice = {"type": "function", "function": {"name": tool_choice.get("name")}}  # chat's spelling
    elif tool_choice not in (None, "auto", "none", "required"):
        raise invalid(
            "tool_choice", tool_choice, 'must be "auto", "none", "required" or {"type": "function", "name": ...}'
        )
    store_it = body.get("store", True)
    if not isinstance(store_it, bool):
        raise invalid("store", store_it, "must be true or false")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise invalid("stream", stream, "must be true or false")
    chat = {
        "model": body.get("model"),
        "messages": ([{"role": "system", "content": instructions}] if instructions else []) + messages,
        "tools": tools,
        "tool_choice": chat_choice,
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
    }
    if response_format is not None:
        chat["response_format"] = response_format
    if body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    limit = body.get("max_output_tokens")
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise invalid("max_output_tokens", limit, "must be a positive integer")
        chat["max_completion_tokens"] = limit
    echo = {
        "instructions": instructions,
        "max_output_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "tools": body.get("tools") or [],
        "tool_choice": tool_choice or "auto",
        "previous_response_id": previous,
        "store": store_it,
        "metadata": body.get("metadata") or {},
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "text": text_echo,
    }
    return ResponseRequest(chat, messages, stream, store_it, echo)


def _text_format(text) -> tuple:
    """The Responses API's `text.format` as chat's `response_format` (None for text), and as echoed back:
    `{"type": "text"}`, `{"type": "json_object"}` or `{"type": "json_schema", "name", "schema", "strict"}`."""
    if text is None:
        return None, {"format": {"type": "text"}}
    fmt = text.get("format") if isinstance(text, dict) else None
    kind = (fmt or {}).get("type", "text") if isinstance(fmt, (dict, type(None))) else None
    if kind == "text":
        return None, {"format": {"type": "text"}}
    if kind == "json_object":
        return {"type": "json_object"}, {"format": fmt}
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}, {"format": fmt}
    raise invalid("text", text, 'must be {"format": {"type": "text" | "json_object" | "json_schema", ...}}')


__all__ = ["ResponseRequest", "parse_response_request"]
