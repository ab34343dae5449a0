"""The server with LoRA adapters (`--lora-modules name=path`), through the official `openai` client: a
request's `model` picks its adapter, concurrent requests of two adapters and of the base share batches and
each gets what `generate()` gives its own (merged) model, `/v1/models` lists the adapters with their parent,
an unknown name is a 404 in OpenAI's format, and the command line's refusals."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from staticformers import AutoModelForCausalLM, AutoTokenizer, CompileConfig, LoraConfig  # noqa: E402
from staticformers.serving.server import ServeOptions, Server, build_loop, build_state, load  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
EAGER = CompileConfig(backend="eager")
ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny Qwen3 with its tokenizer, and two adapters of it (ranks 4 and 8) that change its answers."""
    from tiny import build_hf_model
    from tokenizer_fixtures import build_qwen

    root = Path(tmp_path_factory.mktemp("lora_served"))
    base = root / "base"
    build_qwen(base)
    tok = AutoTokenizer.from_pretrained(str(base))
    build_hf_model("qwen3", vocab_size=len(tok), max_position_embeddings=256,
                   eos_token_id=tok.eos_token_id).save_pretrained(str(base))
    out = {"base": str(base)}
    for name, seed, r in (("sql", 1, 4), ("poem", 2, 8)):
        model = AutoModelForCausalLM.from_pretrained(str(base))
        torch.manual_seed(seed)
        model.add_adapter(LoraConfig(r=r, lora_alpha=2 * r, target_modules=ALL7, init_lora_weights=False))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.mul_(4.0)
        model.save_pretrained(root / name)
        out[name] = str(root / name)
    return out


@pytest.fixture(scope="module")
def server(folders):
    opts = ServeOptions(model=folders["base"], served_model_name="tiny", backend="eager", max_batch_size=4,
                        lora_modules={"sql": folders["sql"], "poem": folders["poem"]})
    model, tok = load(opts)
    s = Server(build_state(model, tok, build_loop(model, opts), opts), grace=2.0)
    s.start()
    yield s
    s.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60.0, max_retries=0)


def expected_text(folders, adapter, prompt, n):
    tok = AutoTokenizer.from_pretrained(folders["base"])
    model = AutoModelForCausalLM.from_pretrained(folders["base"])
    if adapter is not None:
        model.load_adapter(folders[adapter])
        model.merge_and_unload()
    ids = tok(prompt)["input_ids"]
    ids = list(ids.tolist() if hasattr(ids, "tolist") else ids)
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, disable_compile=True)
    return tok.decode(out[0, len(ids):].tolist())


def test_models_lists_the_base_and_its_adapters(client, folders):
    listed = {m.id: m for m in client.models.list().data}
    assert set(listed) == {"tiny", "sql", "poem"}
    assert listed["sql"].parent == "tiny" and listed["sql"].root == folders["sql"]
    assert listed["tiny"].parent is None


def test_each_request_gets_its_adapters_answer_in_shared_batches(client, folders):
    prompt = "The for statement"
    jobs = [("sql", "sql"), ("tiny", None), ("poem", "poem"), ("sql", "sql")]

    def ask(name):
        r = client.completions.create(model=name, prompt=prompt, max_tokens=6, temperature=0.0,
                                      extra_body={"ignore_eos": True})
        return r.model, r.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, [name for name, _ in jobs]))
    for (name, adapter), (served, text) in zip(jobs, answers):
        assert served == name
        assert text == expected_text(folders, adapter, prompt, 6), name
    assert answers[0][1] != answers[1][1]  # the adapter changes the answer


def test_adapter_requests_are_counted_under_the_adapter_s_name(server, client):
    import httpx

    def counted(name: str) -> dict:
        text = httpx.get(server.url + "/metrics", timeout=60).text
        out = {}
        for line in text.splitlines():
            for metric in ("prompt_tokens_total", "generation_tokens_total", "request_success_total",
                           "time_to_first_token_seconds_count"):
                if line.startswith(f"staticformers:{metric}{{") and f'model_name="{name}"' in line:
                    out[metric] = out.get(metric, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    before = {name: counted(name) for name in ("tiny", "sql", "poem")}
    r = client.completions.create(model="poem", prompt="The for statement", max_tokens=5, temperature=0.0,
                                  extra_body={"ignore_eos": True})
    after = {name: counted(name) for name in ("tiny", "sql", "poem")}
    assert after["tiny"] == before["tiny"] and after["sql"] == before["sql"]  # nothing counted under the others
    grew = {k: after["poem"][k] - before["poem"].get(k, 0.0) for k in after["poem"]}
    assert grew == {"prompt_tokens_total": r.usage.prompt_tokens, "generation_tokens_total": 5,
                    "request_success_total": 1, "time_to_first_token_seconds_count": 1}


def test_chat_with_an_adapter_and_an_unknown_model_is_404(client):
    r = client.chat.completions.create(model="poem", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert r.model == "poem" and r.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    body = err.value.body
    assert body["code"] == "model_not_found" and body["param"] == "model"
    assert "'nope' does not exist here: this server serves 'tiny', 'sql', 'poem'" in body["message"]


def test_lora_modules_refusals(folders):
    from staticformers.commands.serve import lora_modules

    assert lora_modules(["a=/x", "b = /y"]) == {"a": "/x", "b": "/y"}
    with pytest.raises(ValueError, match="'a' is not NAME=PATH"):
        lora_modules(["a"])
    with pytest.raises(ValueError, match="names 'a' twice"):
        lora_modules(["a=/x", "a=/y"])
    opts = ServeOptions(model=folders["base"], served_model_name="sql", lora_modules={"sql": folders["sql"]})
    model, tok = load(opts)
    with pytest.raises(ValueError, match="adapter name 'sql' is the base model's served name"):
        build_state(model, tok, build_loop(model, opts), opts)


def test_max_lora_rank_and_max_loras_below_the_adapters_are_refused(folders):
    """--max-lora-rank 2 with a rank-8 adapter (it was raised to 8 silently), --max-loras 1 with two adapters."""
    opts = ServeOptions(model=folders["base"], lora_modules={"sql": folders["sql"], "poem": folders["poem"]},
                        max_lora_rank=2)
    with pytest.raises(ValueError, match=r"^--max-lora-rank 2 is less than the rank 8 of adapter 'poem' \(.*poem\): "
                                         r"pass --max-lora-rank 8 or more, or leave it out\.$"):
        load(opts)
    opts.max_lora_rank, opts.max_loras = None, 1
    with pytest.raises(ValueError, match=r"^--max-loras 1 is less than the 2 adapters of --lora-modules: pass "
                                         r"--max-loras 2 or more"):
        load(opts)
