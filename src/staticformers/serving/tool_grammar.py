"""The grammar of a forced tool call: `tool_choice="required"` or a named function, in the model's format.

Why a module of its own: when a client forces a tool call, the answer must be one (or, with
`parallel_tool_calls`, several) Hermes/Qwen3 blocks, `<tool_call>\\n{"name": ..., "arguments": {...}}\\n
</tool_call>`, the name one of the allowed tools' and the arguments valid against that tool's JSON schema.
That is a Lark grammar in llguidance's dialect (`%json` embeds each tool's schema), compiled like any
other constraint (`generation/constraints.py`). When the vocabulary holds `<tool_call>` as one token (as
Qwen's does), the grammar asks for that token, the way the model was trained to write it; otherwise for
the text.
"""

from __future__ import annotations

import json
from typing import Optional

from ..generation.constraints import StructuredOutputs
from .text import CLOSE, OPEN

# compact JSON, as the chat templates write tool calls (`tojson`) and json.dumps does
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _tag(text: str, token: Optional[int]) -> str:
    return text if token is not None else json.dumps(text)


def tool_call_grammar(
    tools: list, name: Optional[str], parallel: bool, open_id: Optional[int], close_id: Optional[int]
) -> StructuredOutputs:
    """A constraint forcing a call of tool `name` (None: any of `tools`), one call or (`parallel`) one or more
    separated by newlines; `open_id` / `close_id`: the ids of `<tool_call>` / `</tool_call>` when the
    vocabulary holds them as tokens."""
    functions = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    rules = []
    for i, f in enumerate(functions):
        parameters = f.get("parameters") or {"type": "object"}
        schema = {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, "arguments": parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
            "x-guidance": _JSON_STYLE,
        }
        rules.append(f"call_{i}: %json {json.dumps(schema)}")
    block = f'{_tag(OPEN, open_id)} "\\n" call "\\n" {_tag(CLOSE, close_id)}'
    start = 'start: block ("\\n" block)*' if parallel else "start: block"
    lark = "\n".join([start, f"block: {block}", "call: " + " | ".join(f"call_{i}" for i in range(len(rules)))] + rules)
    return StructuredOutputs(lark=lark)


__all__ = ["tool_call_grammar"]
