"""Clients no one here wrote, against one server: an evaluation harness's prompt scoring (`echo` with
`logprobs`, `max_tokens=0`) equal to transformers' log-softmax over the prompt, and the Responses API
through the official `openai` client (text equal to chat completions', streamed and not; function
calls that parse; `previous_response_id`).

One server for the module: starting one costs more than the requests."""

from __future__ import annotations

import json

import pytest
import torch

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
transformers = pytest.importorskip("transformers")
pytest.importorskip("fastapi")

from staticformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from staticformers.serving.server import ServeOptions, Server, build_loop, build_state  # noqa: E402
from staticformers.tokenization.token_bytes import shown_text  # noqa: E402

from tolerances import assert_close  # noqa: E402

TIMEOUT = 60.0


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    from tiny import save_served

    return save_served("qwen3", tmp_path_factory.mktemp("served_clients"))


@pytest.fixture(scope="module")
def tok(folder):
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def server(folder, tok):
    model = AutoModelForCausalLM.from_pretrained(folder)
    opts = ServeOptions(model=folder, served_model_name="tiny", backend="eager", max_batch_size=4)
    s = Server(build_state(model, tok, build_loop(model, opts), opts), grace=2.0)
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)


@pytest.fixture(scope="module")
def hf(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# prompt logprobs
# ---------------------------------------------------------------------------------------------
def test_echo_logprobs_score_the_prompt_as_transformers(client, hf, tok):
    """What lm-evaluation-harness's local-completions sends for loglikelihood: token ids, echo, logprobs=1,
    max_tokens 0 (and 1: the generated token comes after the prompt's)."""
    prompts = [tok("The for statement loops over a list")["input_ids"], tok("A tuple is")["input_ids"]]
    for max_tokens in (0, 1):
        r = client.completions.create(
            model="tiny", prompt=prompts, max_tokens=max_tokens, temperature=0, echo=True, logprobs=1
        )
        for choice in sorted(r.choices, key=lambda c: c.index):
            ids = prompts[choice.index]
            lp = choice.logprobs
            assert len(lp.token_logprobs) == len(ids) + max_tokens
            assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
            with torch.no_grad():
                ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
            want = torch.stack([ref[j - 1, ids[j]] for j in range(1, len(ids))])
            assert_close(torch.tensor(lp.token_logprobs[1 : len(ids)]), want)
            for j in range(1, len(ids)):
                ((text, value),) = lp.top_logprobs[j].items()
                best = int(ref[j - 1].argmax())
                assert text == shown_text(tok, best) and value == pytest.approx(float(ref[j - 1, best]), abs=1e-5)
            assert lp.tokens[: len(ids)] == [shown_text(tok, t) for t in ids]  # bytes:\xNN for part of a character
            assert choice.text.startswith(tok.decode(ids)) and choice.finish_reason == "length"
        assert r.usage.completion_tokens == max_tokens * len(prompts)
    whole = client.completions.create(
        model="tiny", prompt=prompts[1], max_tokens=3, temperature=0, echo=True, logprobs=2
    )
    chunks = list(
        client.completions.create(
            model="tiny", prompt=prompts[1], max_tokens=3, temperature=0, echo=True, logprobs=2, stream=True
        )
    )
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert [t for lp in streamed for t in lp.token_logprobs] == whole.choices[0].logprobs.token_logprobs
    assert [o for lp in streamed for o in lp.text_offset] == whole.choices[0].logprobs.text_offset


def test_max_tokens_zero_needs_echo(server):
    r = httpx.post(
        server.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 0}, timeout=TIMEOUT
    )
    assert r.status_code == 400
    assert "max_tokens=0 is only allowed with echo=true" in r.json()["error"]["message"]


# ---------------------------------------------------------------------------------------------
# the Responses API
# ---------------------------------------------------------------------------------------------
def test_responses_text_equals_chat_streamed_and_not(client):
    messages = [{"role": "system", "content": "Be short."}, {"role": "user", "content": "What is a list?"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    want = chat.choices[0].message.content
    r = client.responses.create(
        model="tiny", instructions="Be short.", input="What is a list?", max_output_tokens=8, temperature=0
    )
    assert r.output_text == want and r.object == "response" and r.model == "tiny"
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    # the same as message items, streamed
    events = list(
        client.responses.create(
            model="tiny",
            input=[
                {"role": "developer", "content": "Be short."},
                {"role": "user", "content": [{"type": "input_text", "text": "What is a list?"}]},
            ],
            max_output_tokens=8,
            temperature=0,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want
    assert events[-1].response.output_text == want
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_previous_response_id_continues_the_conversation(client, server):
    first = client.responses.create(model="tiny", input="Name a number.", max_output_tokens=4, temperature=0)
    second = client.responses.create(
        model="tiny", input="And another?", previous_response_id=first.id, max_output_tokens=4, temperature=0
    )
    chat = client.chat.completions.create(
        model="tiny",
        temperature=0,
        max_tokens=4,
        messages=[
            {"role": "user", "content": "Name a number."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And another?"},
        ],
    )
    assert second.output_text == chat.choices[0].message.content
    assert client.responses.retrieve(second.id).output_text == second.output_text
    with pytest.raises(openai.NotFoundError, match="is not stored here"):
        client.responses.create(model="tiny", input="hi", previous_response_id="resp_unknown")
    with pytest.raises(openai.BadRequestError, match="tools\\[0\\]"):
        client.responses.create(model="tiny", input="hi", tools=[{"type": "web_search"}])
    with pytest.raises(openai.BadRequestError, match="max_output_tokens=0 must be a positive integer"):
        client.responses.create(model="tiny", input="hi", max_output_tokens=0)


def test_response_store_evicts_the_oldest():
    from staticformers.serving.response_store import ResponseStore, StoredResponse

    store = ResponseStore(2)
    for i in range(3):
        store.put(f"r{i}", StoredResponse([], {"id": i}))
    assert store.get("r0") is None and store.get("r1").response == {"id": 1} and len(store) == 2
    with pytest.raises(ValueError, match="must be a non-negative integer"):
        ResponseStore(-1)


def test_responses_function_calls_parse(server, tok):
    """A scripted loop makes the model 'say' a Qwen/Hermes tool call: it comes back as a function_call item,
    whole and streamed; its output sent back as a function_call_output item renders through the template."""
    from test_server import ScriptedLoop

    from staticformers.serving.engine_thread import EngineThread

    answer = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    state = server.state
    real = state.engine
    state.engine = EngineThread(
        ScriptedLoop(real.loop, tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]), state.metrics
    ).start()
    try:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", timeout=TIMEOUT, max_retries=0)
        tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
        r = c.responses.create(model="tiny", input="Weather?", tools=tools, tool_choice="auto")
        (call,) = [o for o in r.output if o.type == "function_call"]
        assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
        assert call.call_id.startswith("call_")
        events = list(c.responses.create(model="tiny", input="Weather?", tools=tools, stream=True))
        deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
        assert len(deltas) == 1 and json.loads(deltas[0].delta) == {"city": "Paris"}
        assert [o.type for o in events[-1].response.output] == ["function_call"]
        follow = c.responses.create(
            model="tiny",
            previous_response_id=r.id,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        )
        assert follow.status == "completed"
    finally:
        state.engine.shutdown(0)
        state.engine = real


# ---------------------------------------------------------------------------------------------
# warm-up by default where a compile is slow
# ---------------------------------------------------------------------------------------------
def test_the_plan_is_precompiled_by_default_on_neuron_and_xla_only():
    import argparse

    from staticformers.backends import for_device
    from staticformers.commands.serve import add_arguments
    from staticformers.serving.server import precompiles

    def warm(kind, **flags):
        return precompiles(for_device(kind), ServeOptions(model="m", **flags))

    assert [warm(k) for k in ("neuron", "xla", "cpu", "cuda")] == [True, True, False, False]
    assert not warm("neuron", precompile=False) and warm("cpu", precompile=True)
    assert not warm("xla", no_compile=True)
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert [p.parse_args(["m", *a]).precompile for a in ([], ["--precompile"], ["--no-precompile"])] == [
        None,
        True,
        False,
    ]
    assert "on for neuron and xla" in " ".join(p.format_help().split())


def test_the_warm_up_can_compile_the_scoring_prefills(folder, tok):
    """With --precompile-prompt-logprobs the plan's scoring prefills are compiled before traffic: an echo
    request with logprobs then compiles nothing."""
    from staticformers.generation.loop import GenerationRequest
    from staticformers.generation.sampling import SamplingParams

    model = AutoModelForCausalLM.from_pretrained(folder)
    opts = ServeOptions(
        model=folder,
        backend="eager",
        max_batch_size=1,
        max_model_len=16,
        precompile=True,
        precompile_prompt_logprobs=True,
    )
    loop = build_loop(model, opts)
    kinds = {row["kind"] for row in loop.engine.stats()}
    assert "score" in kinds
    graphs = loop.engine.graph_count()
    loop.add(GenerationRequest([5, 6, 7], 2, SamplingParams(prompt_logprobs=1)))
    first = None
    while not loop.idle:
        for e in loop.step():
            first = first or e
    assert first.prompt_logprobs[0] is None and len(first.prompt_logprobs) == 3
    assert loop.engine.graph_count() == graphs
