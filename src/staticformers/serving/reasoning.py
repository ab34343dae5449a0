"""Reasoning split out of a chat answer: `--reasoning-parser qwen3` (vLLM's flag and name).

Why a module of its own: a reasoning model writes its thinking inside `<think>...</think>` before the
answer. With a reasoning parser the server returns the thinking as `message.reasoning_content` (streamed
as `delta.reasoning_content`) and only what follows `</think>` as `content`, where tool calls are then
parsed. Where the thinking starts depends on the rendered prompt (`prompt_state`):

- the prompt ends with `</think>` (Qwen3's template with `enable_thinking: false` writes an empty block):
  no reasoning, the whole answer is content;
- the prompt opened `<think>` and did not close it (templates that start the thinking): the answer is
  reasoning until `</think>`;
- otherwise the answer is reasoning if it opens with `<think>`, else content.

A structured output or forced tool call constrains only the answer after the reasoning: its grammar
waits for the `</think>` token (`runs.constraint`), unless the prompt already closed the block.
"""

from __future__ import annotations

from typing import Optional

from .text import _held

PARSERS = {"qwen3": ("<think>", "</think>")}  # name -> (opening tag, closing tag)


def check_parser(name: Optional[str]) -> Optional[str]:
    if name is not None and name not in PARSERS:
        raise ValueError(f"--reasoning-parser {name!r} is not known: use one of {', '.join(sorted(PARSERS))}.")
    return name


def prompt_state(name: str, prompt: str) -> str:
    """ "content" (the prompt closed the thinking), "reasoning" (it opened it) or "open" (the answer decides)."""
    start, end = PARSERS[name]
    if prompt.rstrip().endswith(end):
        return "content"
    return "reasoning" if prompt.rfind(start) > prompt.rfind(end) else "open"


class ReasoningSplitter:
    """Feed a chat answer's text as it streams; get (reasoning delta, content delta) back. What could still
    be the start of a tag is held back until it cannot be, so the deltas join to the split of the whole."""

    def __init__(self, name: str, state: str):
        self.start, self.end = PARSERS[name]
        self.state = state  # "open", "reasoning", "content"
        self._buffer = ""
        self.reasoning: Optional[str] = None  # everything returned as reasoning (None: none)

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self._buffer += text
        reasoning, content = "", ""
        if self.state == "open":
            head = self._buffer.lstrip()
            if head.startswith(self.start):
                self._buffer = head[len(self.start) :]
                self.state = "reasoning"
            elif final or (head and not self.start.startswith(head)):
                self.state = "content"
            else:
                return "", ""
        if self.state == "reasoning":
            end = self._buffer.find(self.end)
            if end >= 0:
                reasoning, self._buffer = self._buffer[:end], self._buffer[end + len(self.end) :]
                self.state = "content"
            else:
                keep = 0 if final else _held(self._buffer, [self.end])
                reasoning, self._buffer = (
                    self._buffer[: len(self._buffer) - keep],
                    self._buffer[len(self._buffer) - keep :],
                )
            if reasoning or self.reasoning is None:
                self.reasoning = (self.reasoning or "") + reasoning
        if self.state == "content":
            content, self._buffer = self._buffer, ""
        return reasoning, content


__all__ = ["PARSERS", "ReasoningSplitter", "check_parser", "prompt_state"]
