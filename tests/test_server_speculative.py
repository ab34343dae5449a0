"""The server with vLLM's `--speculative-config`: prompt lookup and a draft model answer what the server
answers without speculation (greedy text, stop strings), `/metrics` counts proposed and accepted tokens,
no graph is compiled outside the plan after the warm-up, and a bad config is refused in one sentence."""

from __future__ import annotations

import pytest
import torch

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from staticformers import AutoModelForCausalLM, AutoTokenizer, CompileConfig  # noqa: E402
from staticformers.generation.engines import engine_for  # noqa: E402
from staticformers.api.speculative import parse_speculative_config  # noqa: E402
from staticformers.serving.server import ServeOptions, Server, build_loop, build_state  # noqa: E402

TIMEOUT = 60.0
EAGER = CompileConfig(backend="eager")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    from tiny import save_served

    return save_served("llama", tmp_path_factory.mktemp("served_spec"))


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=TIMEOUT).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"staticformers:{name}{{")
    )


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_serving_answers_as_without_and_counts_tokens(folder, method):
    model = AutoModelForCausalLM.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    config = (
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
        if method == "ngram"
        else {"model": folder, "num_speculative_tokens": 2}
    )  # the model as its own draft: every proposal accepted
    opts = ServeOptions(
        model=folder,
        served_model_name="tiny",
        backend="eager",
        max_batch_size=1,
        max_model_len=64,
        precompile=True,
        speculative_config=config,
    )
    loop = build_loop(model, opts)
    graphs = engine_for(model).graph_count()
    server = Server(build_state(model, tok, loop, opts), grace=2.0)
    server.start()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)
        prompt = "one two three four one two three four one two"
        ids = tok(prompt)["input_ids"]
        full = model.generate(torch.tensor([ids]), max_new_tokens=16, eos_token_id=None, compile_config=EAGER)
        text = tok.decode(full[0, len(ids) :].tolist(), skip_special_tokens=True)
        r = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
        )
        assert r.choices[0].text == text
        stop = text[4:7]
        r = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=16, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
        )
        assert r.choices[0].text == text[: text.find(stop)] and r.choices[0].finish_reason == "stop"
        drafted = metric(server.url, "spec_decode_num_draft_tokens_total")
        accepted = metric(server.url, "spec_decode_num_accepted_tokens_total")
        assert drafted == loop.speculator.num_draft_tokens > 0
        assert accepted == loop.speculator.num_accepted_tokens > 0
        if method == "draft":
            assert accepted == drafted
        assert engine_for(model).graph_count() == graphs  # precompiled: the verify step included
    finally:
        server.stop()


@pytest.mark.parametrize(
    "raw, message",
    [
        ("{not json", r"--speculative-config is not valid JSON"),
        ("[1]", r"--speculative-config must be a JSON object"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', r"method 'eagle' is not available"),
        ('{"method": "ngram"}', r"num_speculative_tokens=None must be a positive integer"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}',
            r"key\(s\) draft_tensor_parallel_size that are not read here",
        ),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
            r"prompt_lookup_min=4 is more than prompt_lookup_max=2",
        ),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', r"needs \"model\": the draft model's path"),
    ],
)
def test_a_bad_speculative_config_is_refused_in_one_sentence(raw, message):
    with pytest.raises(ValueError, match=message):
        parse_speculative_config(raw)


def test_the_serve_command_refuses_a_bad_config_before_loading(tmp_path, capsys):
    from staticformers.commands.cli import main

    assert main(["serve", str(tmp_path / "nowhere"), "--speculative-config", '{"method": "ngram"}']) == 2
    assert "num_speculative_tokens=None must be a positive integer" in capsys.readouterr().err
