"""Clients no one here wrote, against one server: an evaluation harness's prompt scoring (`echo` with
`logprobs`, `max_tokens=0`) equal to transformers' log-softmax over the prompt, and the Responses API
through the official `openai` client (text equal to chat completions', streamed and not; function
calls that parse; `previous_response_id`).

One server for the module: starting one costs more than the requests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
transformers = pytest.importorskip("transformers")
pytest.importorskip("fastapi")

from staticformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from staticformers.serving.server import ServeOptions, Server, build_loop, build_state  # noqa: E402

from tolerances import assert_close  # noqa: E402

TIMEOUT = 60.0


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    from tiny import build_hf_model
    from tokenizer_fixtures import build_qwen

    path = Path(tmp_path_factory.mktemp("served_clients"))
    build_qwen(path)
    tok = AutoTokenizer.from_pretrained(str(path))
    build_hf_model("qwen3", vocab_size=len(tok), max_position_embeddings=256,
                   eos_token_id=tok.eos_token_id).save_pretrained(str(path))
    return str(path)


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
        r = client.completions.create(model="tiny", prompt=prompts, max_tokens=max_tokens, temperature=0, echo=True,
                                      logprobs=1)
        for choice in sorted(r.choices, key=lambda c: c.index):
            ids = prompts[choice.index]
            lp = choice.logprobs
            assert len(lp.token_logprobs) == len(ids) + max_tokens
            assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
            with torch.no_grad():
                ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
            want = torch.stack([ref[j - 1, ids[j]] for j in range(1, len(ids))])
            assert_close(torch.tensor(lp.token_logprobs[1:len(ids)]), want)
            for j in range(1, len(ids)):
                (text, value), = lp.top_logprobs[j].items()
                best = int(ref[j - 1].argmax())
                assert text == tok.decode([best]) and value == pytest.approx(float(ref[j - 1, best]), abs=1e-5)
            assert lp.tokens[:len(ids)] == [tok.decode([t]) for t in ids]
            assert choice.text.startswith(tok.decode(ids)) and choice.finish_reason == "length"
        assert r.usage.completion_tokens == max_tokens * len(prompts)
    whole = client.completions.create(model="tiny", prompt=prompts[1], max_tokens=3, temperature=0, echo=True,
                                      logprobs=2)
    chunks = list(client.completions.create(model="tiny", prompt=prompts[1], max_tokens=3, temperature=0, echo=True,
                                            logprobs=2, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert [t for lp in streamed for t in lp.token_logprobs] == whole.choices[0].logprobs.token_logprobs
    assert [o for lp in streamed for o in lp.text_offset] == whole.choices[0].logprobs.text_offset


def test_max_tokens_zero_needs_echo(server):
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 0},
                   timeout=TIMEOUT)
    assert r.status_code == 400
    assert "max_tokens=0 is only allowed with echo=true" in r.json()["error"]["message"]
