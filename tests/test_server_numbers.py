"""Every integer and float a request carries, at the values that used to escape the checks and end as a
500: an integer past 64 bits (`top_k=2**70` overflowed converting to a tensor), an integer past a float's
range (10**400 overflowed `math.isfinite`), NaN and Infinity (which Python's JSON reads and no answer can
repeat: `/v1/responses` echoes `metadata` back), a float literal too large for a float (1e999 reads as
Infinity). Each is a 400 in OpenAI's error JSON naming the field or the number. One server for the module."""

from __future__ import annotations

import re

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from staticformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from staticformers.serving.server import ServeOptions, Server, build_loop, build_state  # noqa: E402

TIMEOUT = 60.0
BIG = 2**70
HUGE = 10**400  # an integer no float holds
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
RESPONSES = {"model": "tiny", "input": "hi", "max_output_tokens": 2}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tiny import save_served

    folder = save_served("qwen3", tmp_path_factory.mktemp("numbers_served"))
    model, tok = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    opts = ServeOptions(model=folder, served_model_name="tiny", backend="eager", max_batch_size=4)
    s = Server(build_state(model, tok, build_loop(model, opts), opts), grace=2.0)
    s.start()
    yield s
    s.stop()


def _fits(name):
    return rf"^{name}={BIG} must be an integer that fits in 64 bits \(at most {2**63 - 1}\)\.$"


def _finite(name):
    return rf"^{name}={HUGE} must be a finite number\.$"


# (path, body, param, the sentence): every integer and float field of every endpoint
CASES = (
    [
        ("/v1/completions", {**COMPLETION, "top_k": BIG}, "top_k", _fits("top_k")),
        ("/v1/chat/completions", {**CHAT, "top_k": BIG}, "top_k", _fits("top_k")),
        ("/v1/completions", {**COMPLETION, "min_tokens": BIG}, "min_tokens", _fits("min_tokens")),
        (
            "/v1/chat/completions",
            {**CHAT, "max_tokens": None, "min_tokens": 2**40},
            "min_tokens",
            r"^min_tokens=1099511627776 is more than the \d+ tokens the prompt leaves within --max-model-len: ask for at "
            r"most \d+\.$",
        ),
        ("/v1/completions", {**COMPLETION, "max_tokens": BIG}, "max_tokens", _fits("max_tokens")),
        ("/v1/chat/completions", {**CHAT, "max_tokens": BIG}, "max_tokens", _fits("max_tokens")),
        (
            "/v1/chat/completions",
            {**CHAT, "max_tokens": None, "max_completion_tokens": BIG},
            "max_completion_tokens",
            _fits("max_completion_tokens"),
        ),
        ("/v1/completions", {**COMPLETION, "n": BIG}, "n", rf"^n={BIG} must be between 1 and 4\.$"),
        ("/v1/completions", {**COMPLETION, "best_of": BIG}, "best_of", rf"^best_of={BIG} is not supported beyond n"),
        (
            "/v1/completions",
            {**COMPLETION, "logprobs": BIG},
            "logprobs",
            rf"^logprobs={BIG} must be between 0 and 20\.$",
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "logprobs": True, "top_logprobs": BIG},
            "top_logprobs",
            rf"^top_logprobs={BIG} must be between 0 and 20\.$",
        ),
        (
            "/v1/completions",
            {**COMPLETION, "seed": BIG},
            "seed",
            rf"^seed={BIG} must be an integer that fits in 64 bits\.$",
        ),
        (
            "/v1/completions",
            {**COMPLETION, "stop_token_ids": [BIG]},
            "stop_token_ids",
            rf"^stop_token_ids=\[{BIG}\] holds ids outside the vocabulary",
        ),
        ("/v1/completions", {**COMPLETION, "prompt": [1, BIG]}, "prompt", rf"^prompt=\[{BIG}\] holds ids outside"),
        ("/detokenize", {"model": "tiny", "tokens": [BIG]}, "tokens", rf"^tokens=\[{BIG}\] are outside the vocabulary"),
        (
            "/v1/responses",
            {**RESPONSES, "max_output_tokens": BIG},
            "max_completion_tokens",
            _fits("max_completion_tokens"),
        ),
    ]
    + [
        (path, {**base, name: HUGE}, name, _finite(name))
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
        for path, base in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT))
    ]
    + [("/v1/responses", {**RESPONSES, name: HUGE}, name, _finite(name)) for name in ("temperature", "top_p")]
)


@pytest.mark.parametrize("path,body,param,pattern", CASES, ids=[f"{c[0]}:{c[2]}:{i}" for i, c in enumerate(CASES)])
def test_an_out_of_range_number_is_a_400_naming_its_field(server, path, body, param, pattern):
    r = httpx.post(server.url + path, json=body, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert re.search(pattern, error["message"]), error["message"]


# NaN, Infinity and 1e999 anywhere in a body: Python's JSON reads them, no answer may carry them back
RAW = [
    ("/v1/responses", b'{"model": "tiny", "input": "hi", "max_output_tokens": 2, "metadata": {"a": NaN}}', "NaN"),
    ("/v1/responses", b'{"model": "tiny", "input": "hi", "max_output_tokens": 2, "metadata": {"a": 1e999}}', "1e999"),
    (
        "/v1/chat/completions",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}',
        "Infinity",
    ),
    ("/v1/completions", b'{"model": "tiny", "prompt": "hi", "top_p": -Infinity}', "-Infinity"),
    ("/tokenize", b'{"model": "tiny", "prompt": "hi", "metadata": [NaN]}', "NaN"),
]


@pytest.mark.parametrize("path,raw,number", RAW, ids=[f"{p}:{n}" for p, _, n in RAW])
def test_nan_and_infinity_anywhere_in_a_body_are_a_400(server, path, raw, number):
    r = httpx.post(server.url + path, content=raw, headers={"content-type": "application/json"}, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["message"] == (
        f"The request body holds the number {number}, which JSON does not allow and no "
        f"answer could repeat: send finite numbers."
    )


def test_a_top_k_past_the_vocabulary_keeps_every_token(server):
    """In 64 bits but past the vocabulary: sampled over every token, not refused and not a 500."""
    r = httpx.post(
        server.url + "/v1/completions",
        json={**COMPLETION, "top_k": 2**40, "temperature": 1.0, "seed": 3},
        timeout=TIMEOUT,
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
