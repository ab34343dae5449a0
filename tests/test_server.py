"""The OpenAI-compatible server, driven by the official `openai` client on 127.0.0.1: greedy text equals
`generate()`, streaming, stop strings, logprobs, `n`, tool calls, every refusal in OpenAI's format, a
disconnecting client, a failing step, and a bounded load test that compiles nothing after warm-up.

Every server binds 127.0.0.1 on a free port, every request has a timeout, and every test stops its
server itself."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time

import pytest
import torch

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
transformers = pytest.importorskip("transformers")

from staticformers import AutoModelForCausalLM, AutoTokenizer, CompileConfig  # noqa: E402
from staticformers.generation.engines import engine_for  # noqa: E402
from staticformers.serving.server import ServeOptions, Server, build_loop, build_state  # noqa: E402

EAGER = CompileConfig(backend="eager")
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    """A tiny Qwen3 with a Qwen-style tokenizer and chat template (tools included), 256 positions."""
    from tiny import save_served

    return save_served("qwen3", tmp_path_factory.mktemp("served"))


@pytest.fixture(scope="module")
def model(folder):
    return AutoModelForCausalLM.from_pretrained(folder)


@pytest.fixture(scope="module")
def tok(folder):
    return AutoTokenizer.from_pretrained(folder)


def start(model, tok, folder, **options) -> Server:
    """A server on a free port of 127.0.0.1, eager steps, 4 slots unless `options` say otherwise."""
    opts = ServeOptions(model=folder, served_model_name="tiny", backend="eager", **{"max_batch_size": 4, **options})
    server = Server(build_state(model, tok, build_loop(model, opts), opts), grace=2.0)
    server.start()
    return server


@pytest.fixture(scope="module")
def server(model, tok, folder):
    s = start(model, tok, folder)
    yield s
    s.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)


def greedy(model, ids: list[int], n: int, **kw) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, compile_config=EAGER, **kw)
    return out[0, len(ids) :].tolist()


def cut_at_eos(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos)] if eos in tokens else tokens


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=TIMEOUT).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(f"staticformers:{name}{{") or line.startswith(f"staticformers:{name} "):
            total += float(line.rsplit(" ", 1)[1])
    return total


# ---------------------------------------------------------------------------------------------
# answers
# ---------------------------------------------------------------------------------------------
def test_completion_greedy_text_equals_generate(client, model, tok):
    prompt = "The for statement"
    ids = tok(prompt)["input_ids"]
    want = cut_at_eos(greedy(model, ids, 12), tok.eos_token_id)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    assert r.choices[0].text == tok.decode(want, skip_special_tokens=True)
    assert r.choices[0].finish_reason == ("stop" if len(want) < 12 else "length")
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want) + (len(want) < 12)
    assert r.object == "text_completion" and r.model == "tiny"


def test_chat_greedy_streamed_and_not_equals_generate(client, model, tok):
    messages = [{"role": "system", "content": "Be short."}, {"role": "user", "content": "What is a list?"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    want = tok.decode(cut_at_eos(greedy(model, ids, 10), tok.eos_token_id), skip_special_tokens=True)
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == len(ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_the_stream_is_openai_server_sent_events(server):
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    payloads = [json.loads(line[6:]) for line in lines[:-1]]
    assert all(p["object"] == "text_completion" for p in payloads)
    assert payloads[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_stop_strings_match_across_tokens_and_are_not_returned(client, model, tok):
    prompt = "Iterate over a sequence"
    ids = tok(prompt)["input_ids"]
    full = tok.decode(greedy(model, ids, 16, eos_token_id=None), skip_special_tokens=True)
    assert len(full) > 6
    stop = full[3:6]  # three characters, very likely across a token boundary
    want = full[: full.find(stop)]
    body = dict(
        model="tiny",
        prompt=prompt,
        max_tokens=16,
        temperature=0,
        stop=[stop, "\x00never"],
        extra_body={"ignore_eos": True},
    )
    r = client.completions.create(**body)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(**body, stream=True))
    assert streamed == want


def test_stop_token_ids_end_the_answer(client, model, tok):
    ids = tok("A tuple is")["input_ids"]
    tokens = greedy(model, ids, 8, eos_token_id=None)
    stop_id = tokens[2]
    first = tokens.index(stop_id)
    r = client.completions.create(
        model="tiny",
        prompt="A tuple is",
        max_tokens=8,
        temperature=0,
        extra_body={"stop_token_ids": [stop_id], "ignore_eos": True},
    )
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == first + 1
    # as vLLM: the stop token is the answer's last token, its text kept unless it is a special token
    assert r.choices[0].text == tok.decode(tokens[: first + 1], skip_special_tokens=True)


def test_n_choices_with_a_seed_are_reproducible(client):
    body = dict(
        model="tiny", prompt="Once", max_tokens=8, temperature=1.0, n=3, seed=5, extra_body={"ignore_eos": True}
    )
    a, b = client.completions.create(**body), client.completions.create(**body)
    texts = [c.text for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2] and texts == [c.text for c in b.choices]
    assert len(set(texts)) > 1  # each choice its own seed
    assert a.usage.completion_tokens == 24


def test_logprobs_are_the_models(client, model, tok):
    prompt = "while"
    ids = tok(prompt)["input_ids"]
    r = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=4, temperature=0, logprobs=3, extra_body={"ignore_eos": True}
    )
    lp = r.choices[0].logprobs
    tokens = greedy(model, ids, 4, eos_token_id=None)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids + tokens])).logits[0, len(ids) - 1 : -1].float()
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens).view(-1, 1)).flatten()
    assert len(lp.token_logprobs) == 4 and all(len(t) <= 3 for t in lp.top_logprobs)
    torch.testing.assert_close(torch.tensor(lp.token_logprobs), want, rtol=1e-4, atol=1e-4)
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    entries = chat.choices[0].logprobs.content
    assert len(entries) == chat.usage.completion_tokens and all(len(e.top_logprobs) == 2 for e in entries)
    assert entries[0].top_logprobs[0].logprob >= entries[0].top_logprobs[1].logprob


def _own_bytes(hf_tok, token: int) -> bytes:
    """A byte-level token's bytes, by transformers' own GPT-2 alphabet (the oracle for `bytes`)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    back = {c: b for b, c in bytes_to_unicode().items()}
    return bytes(back[c] for c in hf_tok.convert_ids_to_tokens(token))


def test_logprobs_of_byte_level_tokens_keep_their_own_keys_and_bytes(client, model, tok, folder):
    """Byte-level tokens that are part of a character all decode to "\ufffd": completion `top_logprobs` keys
    them `bytes:\\xNN` (OpenAI's form), so every one of the top 20 comes back with the model's number, and
    chat `bytes` are each token's own bytes, which join into the answer's text."""
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)

    def shown(t):
        raw = _own_bytes(hf_tok, t)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    ids = tok("while")["input_ids"]
    r = client.completions.create(
        model="tiny", prompt="while", max_tokens=4, temperature=0, logprobs=20, extra_body={"ignore_eos": True}
    )
    tokens = greedy(model, ids, 4, eos_token_id=None)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids + tokens])).logits[0, len(ids) - 1 : -1].float()
    top = torch.log_softmax(logits, -1).topk(20)
    partial = 0
    for position, got in enumerate(r.choices[0].logprobs.top_logprobs):
        want = {shown(t): v for t, v in zip(top.indices[position].tolist(), top.values[position].tolist())}
        assert len(want) == 20 and set(got) == set(want), (position, sorted(got), sorted(want))
        for key, value in want.items():
            assert abs(got[key] - value) < 1e-4, (position, key)
        partial += sum(k.startswith("bytes:") for k in got)
    assert partial >= 2  # byte-level tokens were among them (they collided before)
    messages = [{"role": "user", "content": "é€"}]
    chat = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
        extra_body={"ignore_eos": True},
    )
    ids = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False)[
        "input_ids"
    ]
    tokens = greedy(model, ids, 6, eos_token_id=None)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids + tokens])).logits[0, len(ids) - 1 : -1].float()
    top5 = logits.topk(5).indices.tolist()
    entries = chat.choices[0].logprobs.content
    assert len(entries) == 6
    for e, t, tops in zip(entries, tokens, top5):
        assert bytes(e.bytes) == _own_bytes(hf_tok, t) and e.token == shown(t)
        assert [bytes(x.bytes) for x in e.top_logprobs] == [_own_bytes(hf_tok, i) for i in tops]
        assert [x.token for x in e.top_logprobs] == [shown(i) for i in tops]
    assert any(x.token.startswith("bytes:") for e in entries for x in e.top_logprobs)


def test_models_health_tokenize_and_detokenize(server, tok):
    models = httpx.get(server.url + "/v1/models", timeout=TIMEOUT).json()
    assert [m["id"] for m in models["data"]] == ["tiny"] and models["data"][0]["max_model_len"] == 256
    assert httpx.get(server.url + "/health", timeout=TIMEOUT).status_code == 200
    out = httpx.post(server.url + "/tokenize", json={"prompt": "for x in y"}, timeout=TIMEOUT).json()
    assert out["tokens"] == tok("for x in y")["input_ids"] and out["count"] == len(out["tokens"])
    back = httpx.post(server.url + "/detokenize", json={"tokens": out["tokens"]}, timeout=TIMEOUT).json()
    assert back["prompt"] == "for x in y"
    chat = httpx.post(
        server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=TIMEOUT
    ).json()
    assert chat["count"] > 3


# ---------------------------------------------------------------------------------------------
# refusals
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body,status,pattern",
    [
        ({"prompt": "x", "temperature": 5}, 400, r"temperature=5 must be in \[0.0, 2.0\]"),
        ({"prompt": "x", "top_p": 0}, 400, r"top_p=0 must be in \(0.0, 1.0\]"),
        ({"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens='ten' must be an integer"),
        ({"prompt": "x", "n": 9}, 400, "n=9 must be between 1 and 4"),
        ({"prompt": "x", "logprobs": 30}, 400, "logprobs=30 must be between 0 and 20"),
        ({"prompt": "x", "stop": 3}, 400, "stop=3 must be a string or a list of strings"),
        ({"prompt": "x", "seed": "s"}, 400, "seed='s' must be an integer"),
        ({"prompt": "x", "logit_bias": {"5": 1}}, 400, "logit_bias"),
        ({"prompt": [1, 99999]}, 400, r"ids outside the vocabulary"),
        (
            {"prompt": "x" * 10, "max_tokens": 300},
            400,
            r"\d+ tokens and max_tokens=300: \d+ exceed --max-model-len=256",
        ),
        ({"prompt": "x", "model": "other"}, 404, "'other' does not exist here"),
        ({}, 400, "prompt is required"),
        (
            {"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": True}},
            400,
            r"^stream_options.continuous_usage_stats=True is not supported: only include_usage is\.$",
        ),
        (
            {"prompt": "x", "min_tokens": 9, "max_tokens": 4},
            400,
            r"^min_tokens=9 is more than max_tokens=4: ask for at most 4\.$",
        ),
    ],
)
def test_invalid_fields_are_openai_errors(server, body, status, pattern):
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", **body}, timeout=TIMEOUT)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert re.search(pattern, error["message"]), error["message"]
    assert set(error) == {"message", "type", "param", "code"}


# every field of the issue's list that would change the answer, on the endpoint that would read it
UNHONOURED = [
    ("/v1/completions", "guided_json", {"type": "object"}),
    ("/v1/completions", "guided_regex", "a+"),
    ("/v1/completions", "guided_choice", ["a", "b"]),
    ("/v1/completions", "guided_grammar", "root ::= 'a'"),
    ("/v1/completions", "allowed_token_ids", [5]),
    ("/v1/completions", "bad_words", ["x"]),
    ("/v1/completions", "use_beam_search", True),
    ("/v1/completions", "prompt_logprobs", 1),
    ("/v1/chat/completions", "functions", [{"name": "f"}]),
    ("/v1/chat/completions", "function_call", "auto"),
    ("/v1/chat/completions", "continue_final_message", True),
    ("/v1/chat/completions", "guided_json", {"type": "object"}),
    ("/v1/chat/completions", "prompt_logprobs", 1),
    ("/tokenize", "chat_template", "{{ 'x' }}"),
    ("/detokenize", "skip_special_tokens", False),
]


@pytest.mark.parametrize("path,name,value", UNHONOURED, ids=[f"{p}:{n}" for p, n, _ in UNHONOURED])
def test_a_field_that_would_change_the_answer_is_refused_by_name(server, path, name, value):
    body = {
        "model": "tiny",
        "max_tokens": 2,
        **(
            {"messages": [{"role": "user", "content": "hi"}]}
            if "chat" in path
            else {"prompt": "hi"}
            if "detok" not in path
            else {"tokens": [5]}
        ),
    }
    if path in ("/tokenize", "/detokenize"):
        body.pop("max_tokens")
    r = httpx.post(server.url + path, json={**body, name: value}, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (
        error["param"] == name
        and error["code"] == "unsupported_field"
        and set(error) == {"message", "type", "param", "code"}
    )
    assert error["message"] == (
        f"The field {name!r} is not supported by this server and would change the answer: "
        f"leave it out"
        + (
            " (for 'functions', send \"tools\" instead)"
            if name == "functions"
            else " (for 'function_call', send \"tool_choice\" instead)"
            if name == "function_call"
            else ""
        )
        + "."
    )


def test_every_unknown_field_is_named_and_descriptive_fields_pass(server, tok):
    """Several unknown fields are named together; `user`, `metadata`, `store` (the fields that only describe
    the client, `fields.DESCRIPTIVE`) pass on every endpoint and change nothing."""
    from staticformers.serving.fields import DESCRIPTIVE

    r = httpx.post(
        server.url + "/v1/completions",
        timeout=TIMEOUT,
        json={"model": "tiny", "prompt": "hi", "best_of": 1, "bad_words": ["x"], "use_beam_search": True},
    )
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and message.startswith("The fields 'bad_words', 'use_beam_search' are not supported")
    described = {"user": "u-1", "metadata": {"team": "a"}, "store": False}
    assert {"user", "metadata", "store"} <= DESCRIPTIVE
    plain = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "temperature": 0}
    want = httpx.post(server.url + "/v1/completions", json=plain, timeout=TIMEOUT).json()["choices"][0]["text"]
    got = httpx.post(server.url + "/v1/completions", json={**plain, **described}, timeout=TIMEOUT)
    assert got.status_code == 200 and got.json()["choices"][0]["text"] == want
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **described}
    assert httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=TIMEOUT).status_code == 200
    assert httpx.post(server.url + "/tokenize", json={"prompt": "hi", **described}, timeout=TIMEOUT).status_code == 200
    assert httpx.post(server.url + "/detokenize", json={"tokens": [5], **described}, timeout=TIMEOUT).status_code == 200


def test_bad_json_and_big_bodies(server):
    r = httpx.post(
        server.url + "/v1/completions", content=b"{nope", timeout=TIMEOUT, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", content=b"x" * (5 * 2**20), timeout=TIMEOUT)
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": "hi"}, timeout=TIMEOUT)
    assert r.status_code == 400 and "messages='hi'" in r.json()["error"]["message"]


SURROGATE = '"\\ud800"'  # JSON text for a lone UTF-16 surrogate


@pytest.mark.parametrize(
    "path,body,where",
    [
        ("/v1/completions", '{"model": "tiny", "prompt": %s}', "prompt"),
        (
            "/v1/chat/completions",
            '{"model": "tiny", "messages": [{"role": "user", "content": %s}]}',
            "messages[0].content",
        ),
        (
            "/v1/chat/completions",
            '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": '
            '[{"type": "function", "function": {"name": %s}}]}',
            "tools[0].function.name",
        ),
        ("/tokenize", '{"prompt": %s}', "prompt"),
        ("/v1/completions", '{"model": "tiny", "prompt": "x", %s: 1}', "a key of body"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_where(server, path, body, where):
    r = httpx.post(
        server.url + path,
        content=(body % SURROGATE).encode(),
        timeout=TIMEOUT,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"] == (
        f"{where} holds a lone UTF-16 surrogate ('\\ud800' at character 0), which is not text: send valid Unicode."
    ), error["message"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"


def test_deep_json_unknown_routes_and_handler_bugs_are_openai_json(server, monkeypatch):
    """JSON nested 100k deep (RecursionError in the parser) and 65 deep (past the limit) are 400s; an
    unknown route is 404 and a wrong method 405, in OpenAI's format; a handler that raises is a JSON 500
    and the server goes on."""
    for depth in (100_000, 65):
        r = httpx.post(
            server.url + "/v1/completions",
            content=b"[" * depth + b"]" * depth,
            timeout=TIMEOUT,
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(
            "The request body nests JSON more than 64 levels deep"
        ), r.text
    deep_ok = {"model": "tiny", "prompt": "x", "max_tokens": 1, "metadata": {"a": {"b": {"c": [[[1]]]}}}}
    assert httpx.post(server.url + "/v1/completions", json=deep_ok, timeout=TIMEOUT).status_code == 200
    r = httpx.get(server.url + "/v1/nothing", timeout=TIMEOUT)
    assert r.status_code == 404 and r.json()["error"]["message"] == "There is no endpoint /v1/nothing."
    r = httpx.get(server.url + "/v1/completions", timeout=TIMEOUT)
    assert r.status_code == 405 and r.json()["error"]["message"] == "/v1/completions does not take GET."

    class Broken(dict):
        def items(self):
            raise KeyError("a bug")

    monkeypatch.setattr(server.state, "adapters", Broken())
    r = httpx.get(server.url + "/v1/models", timeout=TIMEOUT)
    assert r.status_code == 500 and r.json()["error"] == {
        "message": "The server failed this request (KeyError): report it.",
        "type": "server_error",
        "param": None,
        "code": None,
    }
    monkeypatch.undo()
    assert httpx.get(server.url + "/v1/models", timeout=TIMEOUT).status_code == 200


@pytest.mark.parametrize(
    "tools,pattern",
    [
        (
            [{"type": "function", "function": {"name": "a b"}}],
            r"^tools\[0\]\.function\.name='a b' must be 1 to 64 letters",
        ),
        ([{"type": "function", "function": {}}], r"^tools\[0\]\.function\.name=None must be 1 to 64 letters"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
            r"^tools\[0\]\.function\.parameters='x' must be a JSON Schema object",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": []}}}],
            r"^tools\[0\]\.function\.parameters=.* must be a JSON Schema object",
        ),
        (
            [{"type": "function", "function": {"name": "f"}}, {"name": "g"}],
            r"^tools\[1\]=\{'name': 'g'\} must be \{\"type\"",
        ),
        ({"name": "f"}, r"^tools=\{'name': 'f'\} must be a list of tool objects"),
    ],
)
def test_a_malformed_tool_is_refused_naming_it(server, tools, pattern):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": tools, "max_tokens": 2}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 400 and re.search(pattern, r.json()["error"]["message"]), r.text


def test_startup_refusals_an_empty_api_key_and_a_broken_chat_template(model, tok, folder, tmp_path, capsys):
    """An empty --api-key would serve without auth, and a template that cannot render would make every chat
    request a 400 blaming its messages: both are refused before serving."""
    from staticformers.commands.cli import main

    assert main(["serve", folder, "--api-key", ""]) == 2
    assert "--api-key is empty, which would leave the server open to anyone" in capsys.readouterr().err
    opts = ServeOptions(model=folder, api_key="  ")
    with pytest.raises(ValueError, match=r"^The API key is empty"):
        build_state(model, tok, build_loop(model, opts), opts)
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }")
    opts = ServeOptions(model=folder, chat_template=str(broken))
    with pytest.raises(
        ValueError,
        match=rf"^--chat-template {re.escape(str(broken))} cannot render a chat of one user "
        rf"message: The chat template has a Jinja syntax error at line 1: .*; fix the template\.$",
    ):
        build_state(model, tok, build_loop(model, opts), opts)


def test_a_huge_prompt_is_refused_by_its_length_and_tokenizing_never_blocks_other_connections(server, monkeypatch):
    """A 3.9 MB prompt is refused by its characters, before it is tokenized; and while a tokenizer works on a
    request, /health still answers: tokenizing and templates run off the event loop. The tokenizer here waits
    until /health has answered (events, not seconds): on the event loop, /health could not answer until it
    gave up waiting."""
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "ab " * 1_300_000}, timeout=TIMEOUT)
    assert r.status_code == 400 and re.fullmatch(
        r"The prompt has 3900000 characters, far more tokens than "
        r"--max-model-len=256 holds: shorten it\.",
        r.json()["error"]["message"],
    )
    real = server.state.tokenizer
    started, answered, seen = threading.Event(), threading.Event(), {}

    class Waiting:
        def __call__(self, *args, **kwargs):
            started.set()
            seen.setdefault("health_answered_meanwhile", answered.wait(timeout=60))
            return real(*args, **kwargs)

        def __len__(self):
            return len(real)

        def __getattr__(self, name):
            return getattr(real, name)

    monkeypatch.setattr(server.state, "tokenizer", Waiting())

    async def both():
        async with httpx.AsyncClient(timeout=TIMEOUT) as c:
            slow = asyncio.create_task(
                c.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1})
            )
            assert await asyncio.to_thread(started.wait, 60), "the request never reached its tokenizer"
            health = await c.get(server.url + "/health")
            answered.set()
            return (await slow), health

    slow, health = asyncio.run(both())
    assert slow.status_code == 200 and health.status_code == 200
    assert seen["health_answered_meanwhile"], "/health waited for a tokenizer: tokenizing blocks the event loop"


def test_the_port_answers_503_with_the_reason_until_the_model_is_ready(server):
    """`serve` binds its port before loading: until the app is ready every request (/health included) is a
    503 in OpenAI's format saying what the server is doing, with Retry-After; then the real app answers."""
    from staticformers.serving.app import create_app
    from staticformers.serving.starting import Starting

    starting = Starting("loading /models/x, then compiling its shape plan")

    async def ask():
        transport = httpx.ASGITransport(app=starting)
        async with httpx.AsyncClient(transport=transport, base_url="http://starting") as c:
            early = [await c.get("/health"), await c.post("/v1/completions", json={"prompt": "x"})]
            starting.ready(create_app(server.state))
            return early, await c.get("/health")

    early, later = asyncio.run(ask())
    for r in early:
        assert r.status_code == 503 and r.headers["Retry-After"] == "5"
        assert r.json()["error"] == {
            "message": "The server is starting (loading /models/x, then compiling its shape plan): retry in a moment.",
            "type": "server_error",
            "param": None,
            "code": None,
        }
    assert later.status_code == 200


def test_api_key(model, tok, folder):
    s = start(model, tok, folder, api_key="sekrit")
    try:
        for headers, status in (
            ({}, 401),
            ({"Authorization": "Bearer wrong"}, 401),
            ({"Authorization": "Bearer sekrit"}, 200),
        ):
            r = httpx.get(s.url + "/v1/models", headers=headers, timeout=TIMEOUT)
            assert r.status_code == status
        assert "API key is missing" in httpx.get(s.url + "/v1/models", timeout=TIMEOUT).json()["error"]["message"]
        assert httpx.get(s.url + "/health", timeout=TIMEOUT).status_code == 200  # health and metrics stay open
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="sekrit", timeout=TIMEOUT, max_retries=0)
        assert c.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=0).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="nope", max_retries=0).models.list()
    finally:
        s.stop()


def test_a_full_queue_is_429_with_retry_after(model, tok, folder):
    s = start(model, tok, folder, max_batch_size=1, max_queued_requests=1)
    try:
        never = httpx.post(
            s.url + "/v1/completions", timeout=TIMEOUT, json={"model": "tiny", "prompt": ["go", "on"], "max_tokens": 2}
        )  # on an idle server
        assert never.status_code == 400 and never.json()["error"]["message"] == (
            "This request asks for 2 sequences (prompts x n), more than the 1 the server's queue holds "
            "(--max-queued-requests): ask for at most 1."
        )

        async def burst():
            async with httpx.AsyncClient(timeout=TIMEOUT) as c:
                body = {"model": "tiny", "prompt": "go", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
                first = asyncio.ensure_future(c.post(s.url + "/v1/completions", json=body))
                deadline = time.monotonic() + 60
                while s.state.engine.running < 1 and not first.done():  # it holds the one slot: the queue is empty
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.005)
                rest = await asyncio.gather(*[c.post(s.url + "/v1/completions", json=body) for _ in range(5)])
                return [await first] + list(rest)

        replies = asyncio.run(burst())
        codes = sorted(r.status_code for r in replies)
        assert codes.count(200) >= 2 and 429 in codes
        refused = [r for r in replies if r.status_code == 429][0]
        assert refused.headers["Retry-After"] == "1" and refused.json()["error"]["type"] == "rate_limit_error"
    finally:
        s.stop()


def test_shutdown_past_the_grace_ends_every_answer_with_abort_and_done(model, tok, folder, caplog, monkeypatch):
    """Three streams and one whole answer still running when the 2 s grace ends: each stream's last chunk
    has finish_reason "abort" and is followed by `[DONE]`, the whole answer comes back with "abort", and
    nothing is logged as an error (no ASGI traceback, no "Event loop is closed")."""
    s = start(model, tok, folder)  # a grace of 2 s
    engine = s.state.engine.loop.engine
    real = engine.decode

    def slow(*args, **kwargs):  # 240 steps take more than 7 s: past the grace on any machine
        time.sleep(0.03)
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "decode", slow)
    body = {"model": "tiny", "prompt": "go", "max_tokens": 240, "temperature": 0, "ignore_eos": True}
    results: dict = {}

    def stream(i):
        with httpx.stream("POST", s.url + "/v1/completions", json={**body, "stream": True}, timeout=TIMEOUT) as r:
            results[i] = [line for line in r.iter_lines() if line]

    def whole():
        results["whole"] = httpx.post(s.url + "/v1/completions", json=body, timeout=TIMEOUT)

    import threading

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)] + [threading.Thread(target=whole)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120  # generous: only a stuck server reaches it
    while s.state.engine.running + s.state.engine.waiting < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert s.state.engine.running + s.state.engine.waiting == 4, "the 4 requests were not all queued within 120 s"
    with caplog.at_level(logging.WARNING):
        started = time.monotonic()
        s.stop()
        for t in threads:
            t.join(timeout=120)
    stopped = time.monotonic() - started
    # the rows needed 7 s or more (240 slowed steps): ending before them is what the grace promises; the bound
    # is only there so that a server that waited for its rows fails with a sentence
    assert not any(t.is_alive() for t in threads) and all(k in results for k in (0, 1, 2, "whole")), (
        f"the answers had not ended {stopped:.1f} s after stop() with a 2 s grace: shutdown waited for the rows"
    )
    for i in range(3):
        lines = results[i]
        assert lines[-1] == "data: [DONE]", lines[-3:]
        assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "abort", lines[-2]
    assert results["whole"].status_code == 200 and results["whole"].json()["choices"][0]["finish_reason"] == "abort"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]


def test_a_client_that_disconnects_mid_stream_frees_its_slot(server):
    before = metric(server.url, "client_disconnects_total")
    body = {"model": "tiny", "prompt": "go on", "max_tokens": 200, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 3:
                break
    deadline = time.monotonic() + 20
    while metric(server.url, "num_requests_running") > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(server.url, "num_requests_running") == 0
    assert metric(server.url, "client_disconnects_total") == before + 1


def test_an_exception_in_a_step_is_500_and_the_server_goes_on(model, tok, folder, monkeypatch):
    s = start(model, tok, folder)
    try:
        engine = s.state.engine.loop.engine
        real = engine.decode
        calls = {"n": 0}

        def failing(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("device lost")
            return real(*args, **kwargs)

        monkeypatch.setattr(engine, "decode", failing)
        body = {"model": "tiny", "prompt": "x", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == 500 and "device lost" in r.json()["error"]["message"]
        ok = httpx.post(s.url + "/v1/completions", json=body, timeout=TIMEOUT)
        assert ok.status_code == 200 and httpx.get(s.url + "/health", timeout=TIMEOUT).status_code == 200
        assert metric(s.url, "request_errors_total") == 1
    finally:
        s.stop()


def test_a_step_that_raises_past_the_loop_fails_its_rows_and_the_next_request_is_served(
    model, tok, folder, monkeypatch
):
    """Fault injection outside the loop's own recovery (its whole `step` raises once): that batch's request
    gets a 500 in OpenAI's format, /health stays 200, and the next request is answered right."""
    s = start(model, tok, folder)
    try:
        loop = s.state.engine.loop
        real = loop.step
        calls = {"n": 0}

        def broken():
            calls["n"] += 1
            if calls["n"] == 2:  # after the prefill: the request holds a slot
                raise SystemError("the loop itself broke")
            return real()

        monkeypatch.setattr(loop, "step", broken)
        body = {"model": "tiny", "prompt": "x", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert "the loop itself broke" in r.json()["error"]["message"]
        assert httpx.get(s.url + "/health", timeout=TIMEOUT).status_code == 200
        ok = httpx.post(s.url + "/v1/completions", json=body, timeout=TIMEOUT)
        assert ok.status_code == 200
        assert ok.json()["choices"][0]["text"] == tok.decode(greedy(model, tok("x")["input_ids"], 3, eos_token_id=None))
        assert loop.running == 0 and loop.cache is None
    finally:
        s.stop()


def test_a_one_token_request_beside_a_longer_one_never_breaks_the_server(server, model, tok):
    """The reported defect: `max_tokens=1` (and a first-token EOS) joining with a longer request on an idle
    server dropped the batch under the other row, and every later request got 503. Twelve rounds: every
    answer is the model's greedy one, and /health stays 200."""
    ids = tok("a b")["input_ids"]
    longer = tok.decode(greedy(model, ids, 8, eos_token_id=None))

    async def rounds():
        async with httpx.AsyncClient(timeout=TIMEOUT) as c:
            out = []
            for _ in range(12):
                one = {"model": "tiny", "prompt": "a b", "max_tokens": 1, "temperature": 0}
                eight = {"model": "tiny", "prompt": "a b", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
                out.append(
                    await asyncio.gather(
                        c.post(server.url + "/v1/completions", json=one),
                        c.post(server.url + "/v1/completions", json=eight),
                    )
                )
            return out

    for one, eight in asyncio.run(rounds()):
        assert one.status_code == 200 and eight.status_code == 200, (one.text, eight.text)
        assert eight.json()["choices"][0]["text"] == longer
    assert httpx.get(server.url + "/health", timeout=TIMEOUT).status_code == 200


def test_health_is_503_once_the_engine_thread_died(model, tok, folder, monkeypatch):
    """Only the engine thread's death (something that is not an `Exception`) stops the server: 500 for the
    request it held, then 503 on /health and for every request, each in OpenAI's format."""

    class Fatal(BaseException):
        pass

    s = start(model, tok, folder)
    try:

        def dead(*args, **kwargs):
            raise Fatal("the thread is gone")

        monkeypatch.setattr(s.state.engine.loop, "step", dead)
        body = {"model": "tiny", "prompt": "x", "max_tokens": 3, "temperature": 0}
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == 500
        health = httpx.get(s.url + "/health", timeout=TIMEOUT)
        assert health.status_code == 503 and "the thread is gone" in health.json()["error"]["message"]
        later = httpx.post(s.url + "/v1/completions", json=body, timeout=TIMEOUT)
        assert later.status_code == 503 and later.json()["error"]["type"] == "server_error"
    finally:
        s.stop()


# ---------------------------------------------------------------------------------------------
# tool calls (the HTTP layer over scripted tokens)
# ---------------------------------------------------------------------------------------------
class ScriptedLoop:
    """Stands in for the generation loop: every request 'generates' the same scripted tokens."""

    def __init__(self, real, script: list):
        self.engine, self.plan, self.max_slots, self.script = real.engine, real.plan, real.max_slots, script
        self.validate = real.validate
        self.waiting, self.progress = [], {}

    def add(self, request):
        self.waiting.append(request.request_id)

    def cancel(self, request_id):
        found = request_id in self.progress or request_id in self.waiting
        self.progress.pop(request_id, None)
        return found

    @property
    def idle(self):
        return not self.waiting and not self.progress

    running = property(lambda self: len(self.progress))
    num_waiting = property(lambda self: len(self.waiting))
    padding_slots = 0

    def step(self):
        from staticformers.generation.loop import TokenEvent

        for rid in self.waiting:
            self.progress[rid] = 0
        self.waiting = []
        events = []
        for rid, i in list(self.progress.items()):
            last = i == len(self.script) - 1
            events.append(TokenEvent(rid, self.script[i], i, "stop" if last else None))
            if last:
                del self.progress[rid]
            else:
                self.progress[rid] = i + 1
        return events

    def close(self):
        pass


def test_tool_calls_streamed_and_not(model, tok, folder):
    """A chat answer in Qwen/Hermes style comes back as OpenAI tool calls: a scripted loop makes the model
    'say' one, so what is tested is the HTTP layer (streamed pieces, content before the call, the call's
    deltas)."""
    from staticformers.serving.engine_thread import EngineThread

    answer = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    script = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    opts = ServeOptions(model=folder, served_model_name="tiny", backend="eager", max_batch_size=4)
    state = build_state(model, tok, build_loop(model, opts), opts)
    state.engine.shutdown(0)
    state.engine = EngineThread(ScriptedLoop(state.engine.loop, script), state.metrics).start()
    s = Server(state, grace=2.0)
    s.start()
    try:
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", timeout=TIMEOUT, max_retries=0)
        r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=tools)
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and message.content == "Let me check."
        (call,) = message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
        assert call.id.startswith("call_") and call.type == "function"
        chunks = list(
            c.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=tools, stream=True
            )
        )
        content = "".join(ch.choices[0].delta.content or "" for ch in chunks)
        calls = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
        # OpenAI's deltas: one per call once its block parsed (index, id, name and the whole arguments), so a
        # block that turns out not to be a call never has a call to take back
        assert content == "Let me check." and [tc.index for tc in calls] == [0]
        assert calls[0].id.startswith("call_") and calls[0].function.name == "get_weather"
        assert calls[0].function.arguments == call.function.arguments
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        plain = c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=tools, tool_choice="none"
        )
        assert plain.choices[0].message.tool_calls is None and "<tool_call>" in plain.choices[0].message.content
    finally:
        s.stop()


# ---------------------------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------------------------
def test_load_64_requests_16_clients_some_disconnecting(model, tok, folder):
    """64 requests of mixed prompt and answer lengths from 16 concurrent clients, every fourth dropping its
    stream after a few chunks: every other one gets its complete greedy answer, equal to its solo run;
    after `--precompile` nothing is compiled (the metric); the whole test has a hard limit."""
    gen = torch.Generator().manual_seed(11)
    words = ["for", "while", "if", "list", "tuple", "dict", "set", "def", "class", "return", "yield", "with"]
    jobs = []
    for i in range(64):
        n = int(torch.randint(1, 12, (1,), generator=gen))
        prompt = " ".join(words[int(j)] for j in torch.randint(0, len(words), (n,), generator=gen))
        jobs.append((prompt, int(torch.randint(1, 24, (1,), generator=gen)), i % 4 == 3))
    solo = {}
    for prompt, max_tokens, drop in jobs:
        if not drop:
            ids = tok(prompt)["input_ids"]
            solo[prompt, max_tokens] = tok.decode(
                cut_at_eos(greedy(model, ids, max_tokens), tok.eos_token_id), skip_special_tokens=True
            )
    s = start(model, tok, folder, precompile=True)
    try:
        compiled_before = metric(s.url, "graphs_compiled_total")

        async def one(c, sem, prompt, max_tokens, drop):
            async with sem:
                body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
                text = ""
                async with c.stream("POST", s.url + "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    seen = 0
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        seen += 1
                        if drop and seen >= 2:
                            return None
                        text += json.loads(line[6:])["choices"][0]["text"]
                return text

        async def run_all():
            sem = asyncio.Semaphore(16)
            async with httpx.AsyncClient(timeout=TIMEOUT) as c:
                return await asyncio.wait_for(asyncio.gather(*[one(c, sem, *j) for j in jobs]), timeout=240)

        results = asyncio.run(run_all())
        for (prompt, max_tokens, drop), text in zip(jobs, results):
            if not drop:
                assert text == solo[prompt, max_tokens], (prompt, max_tokens)
        # since start: what --precompile compiled, and nothing more while serving
        assert metric(s.url, "graphs_compiled_total") == compiled_before == engine_for(model).graph_count() > 0
        deadline = time.monotonic() + 20
        while metric(s.url, "num_requests_running") > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert metric(s.url, "num_requests_running") == 0 and metric(s.url, "num_requests_waiting") == 0
    finally:
        s.stop()


def test_the_precompile_bar_has_the_plan_s_total_and_prints_its_last_line_once(model, folder):
    import io

    from staticformers.serving.server import PrecompileBar, serving_plan

    plan = serving_plan(model, ServeOptions(model=folder, max_batch_size=2, max_model_len=64))
    assert plan.num_shapes == len(plan.decode_shapes()) + len(plan.prefill_shapes()) > 2
    out = io.StringIO()
    bar = PrecompileBar(plan.num_shapes, file=out)
    bar.bar.mininterval = 0  # every update draws, as a slow compile's would
    for i in range(plan.num_shapes):
        bar({"kind": "decode", "shape": [1, 1, 64 + i], "seconds": 0.5})
    bar.close()
    everything = [x for x in re.split(r"[\r\n]", out.getvalue()) if x.strip()]
    lines = [x for x in everything if x.startswith("compiling the shape plan")]  # the bar's
    n = plan.num_shapes
    assert f"0/{n}" in lines[0] and any(f"1/{n}" in x for x in lines)  # a total from the first line on
    # a line before each shape: which one, and the rest's estimate from this run's pace
    said = [x for x in everything if x.startswith("compiling shape ")]
    assert said[0] == f"compiling shape 1/{n}" and len(said) == n
    assert said[1] == f"compiling shape 2/{n} (about {(n - 1) * 0.5:.2f} s left: 500 ms a shape so far in this run)"
    final = [x for x in lines if f"{n}/{n}" in x]
    assert len(final) == 1 and f"decode [1, 1, {63 + n}] 0.5 s" in final[0] and "100%" in final[0]
