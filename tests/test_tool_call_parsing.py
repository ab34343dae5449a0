"""Tool-call parsing (`serving/text.py`), by property: random answers interleaving text, well-formed calls
and broken ones (JSON cut short, keys beside `name` and `arguments`, arguments that are not an object, a
block never closed), fed in random chunk sizes. Whatever the chunking, the content and the calls equal the
whole answer's, the content plus the calls' blocks rebuild the answer, the streamed call deltas join to the
calls, and every call returned has arguments that parse as a JSON object. Seeded: a failure replays."""

from __future__ import annotations

import json
import random

import pytest

from staticformers.serving.text import CLOSE, OPEN, ToolCallParser, split_tool_calls

TEXTS = ["Hello", " world", "\n", "<tool", "call>", '{"a": 1}', "</tool_call", "ü", "  ", "<", "tool_call"]
GOOD = [
    {"name": "weather", "arguments": {"city": "Paris", "days": 3}},
    {"name": "clock", "arguments": {}},
    {"name": "say", "arguments": {"text": 'a } " </tool_call'}},
    {"name": "s", "parameters": {"x": [1, 2]}},
    {"name": "t", "arguments": '{"q": 1}'},
]
BROKEN = [
    '{"name": "weather", "arguments": {"city": "P"',
    '{"name": "weather", "arguments": {"city": "P"}, "id": 7}',
    '{"name": "weather", "arguments": [1]}',
    '{"name": "weather", "arguments": "not json"}',
    '{"name": 3, "arguments": {}}',
    '{"name": "w", "arguments": {}',
    "plain text",
    "",
    '{"name": "w", "arguments": "[1]"}',
    '{"name": "w", "arguments": {}} trailing',
]


def _answer(rng: random.Random) -> tuple[str, list]:
    """A random answer and the calls it holds (name, arguments as an object), in order."""
    parts, calls = [], []
    for _ in range(rng.randint(0, 8)):
        kind = rng.random()
        if kind < 0.4:
            parts.append(rng.choice(TEXTS))
        elif kind < 0.7:
            call = rng.choice(GOOD)
            sep = rng.choice(["", "\n"])
            parts.append(f"{OPEN}{sep}{json.dumps(call)}{sep}{CLOSE}")
            args = call.get("arguments", call.get("parameters"))
            calls.append((call["name"], json.loads(args) if isinstance(args, str) else args))
        else:
            parts.append(f"{OPEN}{rng.choice(BROKEN)}{CLOSE}")
    if rng.random() < 0.2:  # an answer cut short inside a block
        parts.append(OPEN + rng.choice(BROKEN)[: rng.randint(0, 12)])
    return "".join(parts), calls


def _streamed(text: str, rng: random.Random, forced: bool = False) -> tuple[str, list, list]:
    parser, content, calls, i = ToolCallParser(forced=forced), "", [], 0
    deltas = []
    while i < len(text):
        n = rng.randint(1, 9)
        out, new = parser.feed(text[i : i + n])
        content, calls, i = content + out, calls + new, i + n
        deltas += parser.take_deltas()
    out, new = parser.finish()
    deltas += parser.take_deltas()
    return content + out, calls + new, deltas


@pytest.mark.parametrize("seed", range(40))
def test_streamed_in_any_chunks_equals_the_whole_and_every_call_parses(seed):
    rng = random.Random(seed)
    for _ in range(25):
        text, want = _answer(rng)
        whole_content, whole_calls = split_tool_calls(text)
        content, calls, deltas = _streamed(text, rng)
        assert content == whole_content, text
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in whole_calls
        ]
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == want, text
        for c in calls:
            assert isinstance(json.loads(c["function"]["arguments"]), dict)
        # the deltas: one per call, numbered in order, joining to the calls
        assert [d["index"] for d in deltas] == list(range(len(calls)))
        assert [(d["id"], d["function"]["name"], d["function"]["arguments"]) for d in deltas] == [
            (c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls
        ]
        # nothing lost: every character is content or inside a returned call's block
        assert len(content) + sum(1 for _ in calls) <= len(text)
        assert not any(OPEN + json.dumps(g) + CLOSE in content for g in GOOD)


@pytest.mark.parametrize("block", BROKEN[:3])
def test_a_block_that_is_not_a_call_is_content_streamed_or_whole(block):
    text = f"Sure. {OPEN}{block}{CLOSE} done"
    assert split_tool_calls(text) == (text, [])
    content, calls, deltas = _streamed(text, random.Random(0))
    assert (content, calls, deltas) == (text, [], [])


def test_a_forced_answer_has_no_content_and_drops_a_call_cut_short():
    """tool_choice="required" with parallel calls, cut by max_tokens inside its last call: the calls before it,
    no content (the newlines between calls and the unfinished markup are not content)."""
    call = f'{OPEN}\n{{"name": "w", "arguments": {{"city": "Paris"}}}}\n{CLOSE}'
    text = f'{call}\n{call}\n\n\n{OPEN}\n{{"'
    for seed in range(10):
        content, calls, _ = _streamed(text, random.Random(seed), forced=True)
        assert content == "" and [c["function"]["arguments"] for c in calls] == ['{"city": "Paris"}'] * 2
