"""Constraints compile off the event loop, bounded and cached: `/health` is answered while the largest
grammar the server accepts (`--max-grammar-bytes`) compiles, counted in answers received during its compile,
not in seconds; a larger one is a 400 naming the limit before anything compiles; the same constraint sent
twice compiles once. A constraint whose text holds an added token's text (`<think>`, `<tool_call>`) is a
400 saying why (llguidance's mask offered only the added token, its matcher refused it, and the answer was
cut after it with finish "stop"). One server for the module."""

from __future__ import annotations

import re
import threading

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("llguidance")
pytest.importorskip("fastapi")

from staticformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from staticformers.generation.constraints import GrammarCompiler, StructuredOutputs  # noqa: E402
from staticformers.serving import runs  # noqa: E402
from staticformers.serving.server import ServeOptions, Server, build_loop, build_state  # noqa: E402
from staticformers.serving.state import DEFAULT_MAX_GRAMMAR_BYTES  # noqa: E402

TIMEOUT = 120.0
HEALTH_ANSWERS = 3  # /health answers that must arrive while the constraint compiles


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tiny import save_served

    folder = save_served("qwen3", tmp_path_factory.mktemp("grammar_served"))
    model, tok = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    opts = ServeOptions(model=folder, served_model_name="tiny", backend="eager", max_batch_size=2)
    s = Server(build_state(model, tok, build_loop(model, opts), opts), grace=2.0)
    s.start()
    yield s
    s.stop()


def choices(limit: int) -> list:
    """The most strings of 64 characters whose constraint text fits in `limit` bytes (long strings: llguidance's
    parser takes at most 2000 alternatives in one rule)."""
    out: list = []
    while len(StructuredOutputs(choice=out + [_option(len(out))]).text().encode()) <= limit:
        out.append(_option(len(out)))
    return out


def _option(i: int) -> str:
    return f"option {i:05d} " + "abcdefgh" * 7


def ask(server, options: list):
    return httpx.post(
        server.url + "/v1/completions",
        json={
            "model": "tiny",
            "prompt": "Pick:",
            "max_tokens": 100,
            "temperature": 0,
            "structured_outputs": {"choice": options},
        },
        timeout=TIMEOUT,
    )


def test_health_is_answered_while_the_largest_accepted_grammar_compiles(server, monkeypatch):
    options = choices(DEFAULT_MAX_GRAMMAR_BYTES)
    assert (
        len(StructuredOutputs(choice=options).text().encode()) > DEFAULT_MAX_GRAMMAR_BYTES - 100
    )  # one more string would not fit
    compiling, answered, done = threading.Event(), [], threading.Event()
    seen: dict = {}
    real = runs.constraint

    def watched(state, job):
        compiling.set()
        try:
            return real(state, job)  # the real compile of the largest grammar accepted
        finally:
            # still inside the compile step: /health answers can only arrive if the event loop is free
            enough = done.wait(timeout=60)
            seen.update(during=len(answered), enough=enough)

    def poll():
        compiling.wait(timeout=TIMEOUT)
        while not done.is_set() and len(answered) < 1000:
            r = httpx.get(server.url + "/health", timeout=TIMEOUT)
            answered.append(r.status_code)
            if len(answered) >= HEALTH_ANSWERS:
                done.set()

    monkeypatch.setattr(runs, "constraint", watched)
    poller = threading.Thread(target=poll)
    poller.start()
    r = ask(server, options)
    done.set()
    poller.join(timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] in options, r.json()
    assert seen["enough"] and seen["during"] >= HEALTH_ANSWERS, (
        f"/health was answered {seen['during']} times while the grammar compiled: the compile blocks the event loop"
    )
    assert set(answered) == {200}


def test_a_grammar_past_the_limit_is_a_400_naming_it_and_compiles_nothing(server, monkeypatch):
    compiled = []
    real = GrammarCompiler._compile
    monkeypatch.setattr(GrammarCompiler, "_compile", lambda self, *a: compiled.append(1) or real(self, *a))
    options = choices(DEFAULT_MAX_GRAMMAR_BYTES) + [_option(10**4)]  # one string more than fits
    size = len(StructuredOutputs(choice=options).text().encode())
    r = ask(server, options)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == "structured_outputs.choice"
    assert error["message"] == (
        f"structured_outputs.choice is {size} bytes, more than this server compiles (--max-grammar-bytes="
        f"{DEFAULT_MAX_GRAMMAR_BYTES}): a grammar's compile time grows faster than its size; send a smaller one, or "
        f"restart the server with a larger --max-grammar-bytes."
    )
    assert compiled == []


def test_the_same_constraint_compiles_once(server, monkeypatch):
    compiled = []
    real = GrammarCompiler._compile
    monkeypatch.setattr(GrammarCompiler, "_compile", lambda self, *a: compiled.append(1) or real(self, *a))
    regex = r"[a-c]{2}-unique-to-this-test"
    for _ in range(2):
        r = httpx.post(
            server.url + "/v1/completions",
            json={
                "model": "tiny",
                "prompt": "x",
                "max_tokens": 30,
                "temperature": 0,
                "structured_outputs": {"regex": regex},
            },
            timeout=TIMEOUT,
        )
        assert r.status_code == 200 and re.fullmatch(regex, r.json()["choices"][0]["text"]), r.text
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
    for keys in (list(schema["properties"]), list(reversed(schema["properties"]))):  # the same schema, reordered
        body = {"type": "object", "properties": {k: schema["properties"][k] for k in keys}}
        r = httpx.post(
            server.url + "/v1/completions",
            json={
                "model": "tiny",
                "prompt": "x",
                "max_tokens": 4,
                "temperature": 0,
                "structured_outputs": {"json": body},
            },
            timeout=TIMEOUT,
        )
        assert r.status_code == 200, r.text
    assert len(compiled) == 2, compiled  # one regex, one schema


@pytest.mark.parametrize(
    "field,value,param,held",
    [
        ("structured_outputs", {"choice": ["<think>hello", "bye"]}, "structured_outputs.choice", "<think>"),
        ("structured_outputs", {"regex": "a <tool_call> b"}, "structured_outputs.regex", "<tool_call>"),
        (
            "response_format",
            {
                "type": "json_schema",
                "json_schema": {
                    "name": "t",
                    "schema": {"type": "object", "properties": {"tag": {"const": "</think>"}}, "required": ["tag"]},
                },
            },
            "response_format.json_schema.schema",
            "</think>",
        ),
    ],
)
def test_a_constraint_holding_an_added_token_s_text_is_a_400_saying_why(server, field, value, param, held):
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, field: value},
        timeout=TIMEOUT,
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert error["message"] == (
        f"{param} holds {held!r}, the text of one of the model's added tokens, which a constrained answer cannot "
        f"write (the mask offers only the added token, which the grammar then refuses): leave it out of the "
        f"constraint."
    )
