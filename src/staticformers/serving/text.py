"""From token ids to the text a response carries: streaming detokenisation, stop strings, tool calls.

- `ChoiceText` decodes one choice's tokens incrementally (`generation.streamers.IncrementalDecoder`:
  never half a character) and matches the request's stop strings across token boundaries: text that
  could be the start of a stop string is held back until it cannot be, a matched stop string ends the
  choice and is not included, and everything emitted joins to exactly the final text.
- `ToolCallParser` splits a chat model's text into content and tool calls written in the Qwen/Hermes
  style, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, streamed or not: text before a
  call streams as content, a call is emitted whole once its closing tag arrives and its JSON parses
  (OpenAI's `tool_calls`, arguments as a JSON string), and a block that is not a call (JSON that does
  not parse, keys beside `name` and `arguments`) is returned as content. A call is streamed as one
  OpenAI call delta (`take_deltas`) once its block is complete and parsed, never before: a call whose
  arguments had streamed could not be taken back when its block then failed to parse.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Optional

from ..generation.streamers import IncrementalDecoder

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def _held(text: str, needles: list[str]) -> int:
    """How many characters at the end of `text` could begin one of `needles` (kept back)."""
    best = 0
    for needle in needles:
        for k in range(min(len(needle) - 1, len(text)), 0, -1):
            if text.endswith(needle[:k]):
                best = max(best, k)
                break
    return best


class ChoiceText:
    """One choice's text: `push(token) -> delta`; `stopped` once a stop string matched."""

    def __init__(self, tokenizer, stop: list[str], skip_special_tokens: bool = True):
        self.decoder = IncrementalDecoder(tokenizer, skip_special_tokens=skip_special_tokens)
        self.stop = stop
        self.text = ""  # decoded so far (stop string and after it cut)
        self.emitted = 0
        self.stopped = False

    def push(self, token: int) -> str:
        if self.stopped:
            return ""
        self.text += self.decoder.push([token])
        return self._release(final=False)

    def finish(self) -> str:
        """The rest of the text (the decoder's last characters, what was held back)."""
        if not self.stopped:
            self.text += self.decoder.finish()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stop and not self.stopped:
            start = max(0, self.emitted - max(len(s) for s in self.stop))
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
        keep = 0 if (final or self.stopped or not self.stop) else _held(self.text[self.emitted :], self.stop)
        end = len(self.text) - keep
        out = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return out


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def parse_call(block: str) -> Optional[dict]:
    """An OpenAI tool call from the JSON inside one `<tool_call>` block, or None when it is not one: the
    block must be one JSON object of exactly a string `name` and `arguments` (or `parameters`) that are a
    JSON object, given as an object or as the text of one. Anything else (cut short, keys beside them,
    arguments that do not parse) is not a call, so every call returned carries arguments that parse."""
    try:
        data = json.loads(block.strip())
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    keys = set(data) - {"name"}
    if len(keys) > 1 or not keys <= {"arguments", "parameters"}:
        return None
    arguments = data[keys.pop()] if keys else {}
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return None
        if not isinstance(parsed, dict):
            return None
    elif isinstance(arguments, dict):
        arguments = json.dumps(arguments, ensure_ascii=False)
    else:
        return None
    return {"id": new_call_id(), "type": "function", "function": {"name": data["name"], "arguments": arguments}}


@dataclass
class ToolCallParser:
    """Content and tool calls of a chat answer (see the module docstring); feed it text deltas.

    `forced` (a forced tool call: `tool_choice` "required" or a named function): the grammar allows nothing
    but calls and the newlines between them, so no content is returned, and a block cut short (the answer
    ran out of tokens mid-call) is dropped rather than shown as content."""

    forced: bool = False
    content: str = ""  # everything returned as content so far
    calls: list = field(default_factory=list)
    _buffer: str = ""  # text not yet classified
    _inside: bool = False
    _deltas: list = field(default_factory=list)  # OpenAI call deltas not yet taken

    def take_deltas(self) -> list:
        """The call deltas (`{"index", "id", "type", "function": {"name", "arguments"}}`, one per call, its
        arguments whole) produced since the last call."""
        out, self._deltas = self._deltas, []
        return out

    def _close(self, block: str) -> Optional[dict]:
        """The call a complete block holds (None: not a call), its delta queued."""
        call = parse_call(block)
        if call is not None:
            self._deltas.append({"index": len(self.calls), **call})
            self.calls.append(call)
        return call

    def _content(self, text: str) -> str:
        return "" if self.forced else text

    def feed(self, text: str) -> tuple[str, list]:
        """Add text; return (content delta, new tool calls)."""
        self._buffer += text
        out, new = "", []
        while True:
            if self._inside:
                end = self._buffer.find(CLOSE)
                if end < 0:
                    break
                block, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE) :]
                self._inside = False
                call = self._close(block)
                if call is None:
                    out += self._content(OPEN + block + CLOSE)
                else:
                    new.append(call)
                continue
            start = self._buffer.find(OPEN)
            if start >= 0:
                out += self._content(self._buffer[:start])
                self._buffer = self._buffer[start + len(OPEN) :]
                self._inside = True
                continue
            keep = _held(self._buffer, [OPEN])
            out += self._content(self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep :]
            break
        self.content += out
        return out, new

    def finish(self) -> tuple[str, list]:
        """The end of the answer: an unclosed block is tried as a call, else returned as content (dropped
        when `forced`)."""
        out, new = "", []
        if self._inside:
            call = self._close(self._buffer)
            if call is None:
                out = self._content(OPEN + self._buffer)
            else:
                new.append(call)
        else:
            out = self._content(self._buffer)
        self._buffer, self._inside = "", False
        self.content += out
        return out, new


def split_tool_calls(text: str) -> tuple[str, list]:
    """The whole answer at once: (content, tool calls)."""
    parser = ToolCallParser()
    parser.feed(text)
    parser.finish()
    return parser.content, parser.calls


__all__ = ["ChoiceText", "ToolCallParser", "split_tool_calls", "parse_call"]
