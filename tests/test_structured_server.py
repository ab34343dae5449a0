"""Structured outputs and forced tool calls through the official `openai` client, from a random tiny model
sampling at temperature 1: every one of 50 answers parses and validates (`jsonschema`) for a strict JSON
schema, and matches its regex, choice or EBNF grammar (only the mask can make that true); `tool_choice`
"required" or a named function always gives valid `tool_calls`, streamed deltas joining to the whole
answer's; the Responses API takes the same (`text.format`, a named function); a bad schema, regex or grammar
is a 400 naming the field. One server for the module."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
httpx = pytest.importorskip("httpx")
pytest.importorskip("llguidance")
pytest.importorskip("fastapi")

from staticformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from staticformers.serving.server import ServeOptions, Server, build_loop, build_state  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["cat", "dog"]},
    },
    "required": ["ok", "n", "kind"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "clock",
        "parameters": {
            "type": "object",
            "properties": {"utc": {"type": "boolean"}},
            "required": ["utc"],
            "additionalProperties": False,
        },
    },
}
MESSAGES = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from tiny import save_served

    folder = save_served("qwen3", tmp_path_factory.mktemp("structured_served"), positions=768)
    model, tok = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    opts = ServeOptions(model=folder, served_model_name="tiny", backend="eager", max_batch_size=16)
    server = Server(build_state(model, tok, build_loop(model, opts), opts), grace=2.0)
    server.start()
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120.0, max_retries=0)
    server.stop()


def fifty(call) -> list:
    """50 sampled answers: 5 concurrent requests of n=10, seeds apart."""
    with ThreadPoolExecutor(5) as pool:
        responses = list(pool.map(call, [1000 * i for i in range(5)]))
    choices = [c for r in responses for c in r.choices]
    assert len(choices) == 50
    return choices


def test_json_schema_strict_answers_all_validate(client):
    choices = fifty(
        lambda seed: client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            n=10,
            temperature=1.0,
            seed=seed,
            max_tokens=60,
            response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}},
        )
    )
    for c in choices:
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
        assert c.finish_reason == "stop"
    assert len({c.message.content for c in choices}) > 5  # sampled, not one forced answer
    metrics = httpx.get(str(client.base_url).rstrip("/").removesuffix("/v1") + "/metrics", timeout=30).text
    steps = re.search(r"^staticformers:structured_mask_steps\{[^}]*\} ([0-9.e+]+)$", metrics, re.M)
    assert steps and float(steps.group(1)) > 0  # the mask's host time is reported


def test_regex_choice_and_grammar_answers_all_match(client):
    regex = r"[0-9]{3}-[a-z]{2,4}"
    for c in fifty(
        lambda seed: client.completions.create(
            model="tiny",
            prompt="Code:",
            n=10,
            temperature=1.0,
            seed=seed,
            max_tokens=20,
            extra_body={"structured_outputs": {"regex": regex}},
        )
    ):
        assert re.fullmatch(regex, c.text), c.text
    options = ["red", "green", "blue sky"]
    for c in fifty(
        lambda seed: client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            n=10,
            temperature=1.0,
            seed=seed,
            max_tokens=10,
            extra_body={"structured_outputs": {"choice": options}},
        )
    ):
        assert c.message.content in options and c.finish_reason == "stop"
    grammar = 'root ::= "(" num (op num)* ")"\nnum ::= [1-9] [0-9]?\nop ::= "+" | "*"\n'
    for c in fifty(
        lambda seed: client.completions.create(
            model="tiny",
            prompt="Sum:",
            n=10,
            temperature=1.0,
            seed=seed,
            max_tokens=40,
            extra_body={"structured_outputs": {"grammar": grammar}},
        )
    ):
        assert re.fullmatch(r"\([1-9][0-9]?([+*][1-9][0-9]?)*\)", c.text), c.text


def test_json_object_answers_are_objects(client):
    r = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        n=8,
        temperature=0.7,
        seed=3,
        max_tokens=60,
        response_format={"type": "json_object"},
    )
    parsed = [json.loads(c.message.content) for c in r.choices if c.finish_reason == "stop"]
    assert parsed and all(isinstance(p, dict) for p in parsed)


@pytest.mark.parametrize(
    "extra, field, words",
    [
        ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex", "unclosed group"),
        ({"structured_outputs": {"grammar": "root ::= nothing_here"}}, "structured_outputs.grammar", "nothing_here"),
        ({"structured_outputs": {"json": {"type": "objectx"}}}, "structured_outputs.json", "objectx"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"pattern": "a"}}, "structured_outputs.pattern", "not supported"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
            "response_format.json_schema.schema",
            "objectx",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format", "json_schema"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]},
            "tool_choice.function.name",
            "weather",
        ),
    ],
)
def test_bad_constraints_are_a_400_naming_the_field(client, extra, field, words):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, extra_body=extra)
    error = info.value.body
    assert error["param"] == field and words in error["message"], error


def test_forced_tool_calls_are_always_valid_and_stream_as_they_answer(client):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    r = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=[WEATHER, CLOCK],
        tool_choice="required",
        n=12,
        temperature=1.0,
        seed=5,
        max_tokens=100,
    )
    complete = 0
    for c in r.choices:  # parallel calls: the grammar allows more until the answer is cut ("length")
        assert c.finish_reason in ("tool_calls", "length"), c
        complete += c.finish_reason == "tool_calls"
        assert c.message.tool_calls or c.finish_reason == "length", c
        # a call cut short by max_tokens is dropped: neither a call nor its markup in the content
        assert not c.message.content, c.message.content
        for call in c.message.tool_calls or []:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    assert complete >= 6
    # a named function means exactly one call of it, parallel calls allowed or not
    one = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=[WEATHER, CLOCK],
        n=6,
        seed=9,
        tool_choice={"type": "function", "function": {"name": "clock"}},
        temperature=1.0,
        max_tokens=60,
    )
    for c in one.choices:
        assert [call.function.name for call in c.message.tool_calls] == ["clock"]
        assert c.finish_reason == "tool_calls" and not c.message.content
        jsonschema.validate(json.loads(c.message.tool_calls[0].function.arguments), schemas["clock"])
    # streamed with the same seed: the deltas join to the same calls
    args = dict(
        model="tiny",
        messages=MESSAGES,
        tools=[WEATHER, CLOCK],
        tool_choice="required",
        temperature=1.0,
        seed=21,
        max_tokens=80,
    )
    whole = client.chat.completions.create(**args).choices[0].message.tool_calls
    calls: dict = {}
    fragments = 0
    for chunk in client.chat.completions.create(**args, stream=True):
        for d in chunk.choices[0].delta.tool_calls or []:
            fragments += d.id is None
            call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = d.id or call["id"]
            call["name"] += (d.function.name or "") if d.function else ""
            call["arguments"] += (d.function.arguments or "") if d.function else ""
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in whole
    ]
    assert all(c["id"] for c in calls.values())
    assert fragments == 0  # each call in one delta, once its block parsed: a call never has to be taken back


def test_the_responses_api_takes_a_json_schema_and_a_forced_call(client):
    fmt = {"format": {"type": "json_schema", "name": "pet", "schema": SCHEMA, "strict": True}}
    for _ in range(3):  # sampled (the Responses API takes no seed)
        r = client.responses.create(model="tiny", input="Hello there", text=fmt, temperature=1.0, max_output_tokens=60)
        jsonschema.validate(json.loads(r.output_text), SCHEMA)
        assert r.text.format.type == "json_schema"
    weather = {"type": "function", **WEATHER["function"]}
    r = client.responses.create(
        model="tiny",
        input="Hello there",
        tools=[weather],
        temperature=1.0,
        tool_choice={"type": "function", "name": "weather"},
        parallel_tool_calls=False,
        max_output_tokens=60,
    )
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
