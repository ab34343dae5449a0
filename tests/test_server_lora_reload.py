"""Adapters loaded at run time with prefix caching on: an adapter unloaded and loaded again under the same
name from other files answers a prompt cached under the old one exactly as a fresh engine holding only the
new adapter does (the bank rewrites the same slot in place, so the prefix cache's key holds each load's
number and the old load's blocks are freed; with a KV block pool the shared blocks' keys are dropped), and the
reserved name `__base__` is refused (it means the base
model: requests naming it would get no adapter). One server for the module."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from staticformers import AutoModelForCausalLM, AutoTokenizer, LoraConfig  # noqa: E402
from staticformers.adapters.bank import bank_of  # noqa: E402
from staticformers.serving.server import ServeOptions, Server, build_loop, build_state, load  # noqa: E402

ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = list(range(10, 60))  # 50 tokens: 6 blocks of 8 cached
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny Qwen3 and two adapters of it (other seeds, other answers) under one root."""
    from tiny import build_hf_model
    from tokenizer_fixtures import build_qwen

    root = Path(tmp_path_factory.mktemp("lora_reload"))
    base = root / "base"
    build_qwen(base)
    tok = AutoTokenizer.from_pretrained(str(base))
    build_hf_model(
        "qwen3", vocab_size=len(tok), max_position_embeddings=256, eos_token_id=tok.eos_token_id
    ).save_pretrained(str(base))
    out = {"base": str(base)}
    for name, seed in (("old", 1), ("new", 2)):
        model = AutoModelForCausalLM.from_pretrained(str(base))
        torch.manual_seed(seed)
        model.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=ALL7, init_lora_weights=False))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.mul_(4.0)
        model.save_pretrained(root / name)
        out[name] = str(root / name)
    return out


@pytest.fixture(scope="module", params=["copied", "shared"])
def server(folders, request):
    """The prefix cache copying its blocks into static rows, or sharing the blocks of a KV block pool."""
    blocks = 32 if request.param == "shared" else None
    opts = ServeOptions(
        model=folders["base"],
        served_model_name="tiny",
        backend="eager",
        max_batch_size=2,
        max_model_len=64,
        enable_lora_runtime_updates=True,
        lora_root=str(Path(folders["base"]).parent),
        max_loras=2,
        enable_prefix_caching=True,
        block_size=8,
        num_gpu_blocks_override=blocks,
    )
    model, tok = load(opts)
    s = Server(build_state(model, tok, build_loop(model, opts), opts), grace=2.0)
    s.start()
    yield s
    s.stop()


def post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=TIMEOUT)


def fresh_tokens(folders, adapter: str, n: int) -> list:
    """Greedy tokens of a fresh model holding only `adapter` (merged), no pool."""
    model = AutoModelForCausalLM.from_pretrained(folders["base"])
    model.load_adapter(folders[adapter])
    model.merge_and_unload()
    out = model.generate(
        torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False, eos_token_id=None, disable_compile=True
    )
    return out[0, len(PROMPT) :].tolist()


def answer(server, name: str) -> str:
    r = post(
        server,
        "/v1/completions",
        {
            "model": name,
            "prompt": PROMPT,
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
            "skip_special_tokens": False,
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 6
    return r.json()["choices"][0]["text"]


def text(server, tokens: list) -> str:
    return server.state.tokenizer.decode(tokens)


def hits(server) -> float:
    for line in httpx.get(server.url + "/metrics", timeout=TIMEOUT).text.splitlines():
        if line.startswith("staticformers:prefix_cache_hits_total{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("prefix_cache_hits_total is not on /metrics")


def cached_blocks(loop) -> int:
    """Blocks the prefix cache holds: the copy pool's, or the block pool's registered ones."""
    return loop.blocks.cached if loop.share else loop.prefix.used


def test_an_adapter_reloaded_under_its_name_answers_as_the_new_adapter(server, folders):
    old, new = fresh_tokens(folders, "old", 6), fresh_tokens(folders, "new", 6)
    assert text(server, old) != text(server, new)  # the two adapters answer differently
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": folders["old"]}).status_code == 200
    try:
        first = hits(server)
        assert answer(server, "x") == text(server, old)
        assert answer(server, "x") == text(server, old)  # from the pool this time
        assert hits(server) == first + 48
        loop = server.state.engine.loop
        cached = cached_blocks(loop)
        assert post(server, "/v1/unload_lora_adapter", {"lora_name": "x"}).status_code == 200
        assert post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": folders["new"]}).status_code == 200
        assert answer(server, "x") == text(server, new)  # no block of the old load matched
        assert hits(server) == first + 48
        assert cached_blocks(loop) == cached  # the old load's 6 blocks were freed, the new load's 6 stored
        assert answer(server, "x") == text(server, new)  # the new load's own blocks
        assert hits(server) == first + 96
    finally:
        post(server, "/v1/unload_lora_adapter", {"lora_name": "x"})


@pytest.mark.parametrize("name", ["__base__"])
def test_a_reserved_adapter_name_is_refused(server, folders, name):
    r = post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": folders["old"]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == "lora_name"
    assert error["message"] == (
        f"lora_name={name!r} is reserved: it names the base model without an adapter. Pick another name."
    )
    names = {m["id"] for m in httpx.get(server.url + "/v1/models", timeout=TIMEOUT).json()["data"]}
    assert name not in names and not bank_of(server.state.engine.loop.engine.model).slots


def test_a_reserved_name_in_lora_modules_is_refused_at_start(folders):
    opts = ServeOptions(model=folders["base"], lora_modules={"__base__": folders["old"]})
    with pytest.raises(
        ValueError,
        match=r"^The adapter name '__base__' in --lora-modules is reserved: it names the "
        r"base model without an adapter\. Pick another name\.$",
    ):
        load(opts)
