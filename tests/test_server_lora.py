"""The server with LoRA adapters (`--lora-modules name=path`), through the official `openai` client: a
request's `model` picks its adapter, concurrent requests of two adapters and of the base share batches and
each gets what `generate()` gives its own (merged) model, `/v1/models` lists the adapters with their parent,
an unknown name is a 404 in OpenAI's format, and the command line's refusals. Adapters loaded and unloaded
at run time (`--enable-lora-runtime-updates`) under 8 concurrent clients: nothing compiles, a loaded
adapter's greedy rows equal peft's, an unload waits for its rows, and every refusal."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from pathlib import Path

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from staticformers import AutoModelForCausalLM, AutoTokenizer, CompileConfig, LoraConfig  # noqa: E402
from staticformers.serving.server import ServeOptions, Server, build_loop, build_state, load  # noqa: E402

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
    build_hf_model(
        "qwen3", vocab_size=len(tok), max_position_embeddings=256, eos_token_id=tok.eos_token_id
    ).save_pretrained(str(base))
    out = {"base": str(base)}
    for name, seed, r in (("sql", 1, 4), ("poem", 2, 8), ("third", 3, 8), ("wide", 4, 32)):
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
    """The base, sql and poem, room for one more adapter loaded at run time from the folders' root; the plan
    (32 positions) compiled first, so that the graph count must not move after."""
    opts = ServeOptions(
        model=folders["base"],
        served_model_name="tiny",
        backend="eager",
        max_batch_size=4,
        lora_modules={"sql": folders["sql"], "poem": folders["poem"]},
        max_model_len=32,
        enable_lora_runtime_updates=True,
        lora_root=str(Path(folders["base"]).parent),
        max_loras=3,
        precompile=True,
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls on a shared machine; set before the plan compiles (Dynamo guards on it)
    model, tok = load(opts)
    s = Server(build_state(model, tok, build_loop(model, opts), opts), grace=2.0)
    s.start()
    yield s
    s.stop()
    torch.set_num_threads(threads)


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
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, disable_compile=True
    )
    return tok.decode(out[0, len(ids) :].tolist())


def test_models_lists_the_base_and_its_adapters(client, folders):
    listed = {m.id: m for m in client.models.list().data}
    assert set(listed) == {"tiny", "sql", "poem"}
    assert listed["sql"].parent == "tiny" and listed["sql"].root == folders["sql"]
    assert listed["tiny"].parent is None


def test_each_request_gets_its_adapters_answer_in_shared_batches(client, folders):
    prompt = "The for statement"
    jobs = [("sql", "sql"), ("tiny", None), ("poem", "poem"), ("sql", "sql")]

    def ask(name):
        r = client.completions.create(
            model=name, prompt=prompt, max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True}
        )
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
            for metric in (
                "prompt_tokens_total",
                "generation_tokens_total",
                "request_success_total",
                "time_to_first_token_seconds_count",
            ):
                if line.startswith(f"staticformers:{metric}{{") and f'model_name="{name}"' in line:
                    out[metric] = out.get(metric, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    before = {name: counted(name) for name in ("tiny", "sql", "poem")}
    r = client.completions.create(
        model="poem", prompt="The for statement", max_tokens=5, temperature=0.0, extra_body={"ignore_eos": True}
    )
    after = {name: counted(name) for name in ("tiny", "sql", "poem")}
    assert after["tiny"] == before["tiny"] and after["sql"] == before["sql"]  # nothing counted under the others
    grew = {k: after["poem"][k] - before["poem"].get(k, 0.0) for k in after["poem"]}
    assert grew == {
        "prompt_tokens_total": r.usage.prompt_tokens,
        "generation_tokens_total": 5,
        "request_success_total": 1,
        "time_to_first_token_seconds_count": 1,
    }


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


# ---------------------------------------------------------------------------------------------
# adapters loaded and unloaded at run time
# ---------------------------------------------------------------------------------------------
def peft_greedy(folders, adapter: str, prompt: str, n: int) -> str:
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    tok = AutoTokenizer.from_pretrained(folders["base"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(folders["base"], torch_dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(hf, folders[adapter]).eval()
    ids = torch.tensor([tok(prompt)["input_ids"]])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return tok.decode(out[0, ids.shape[1] :].tolist())


def post(server, route: str, body: dict):
    import httpx

    return httpx.post(server.url + route, json=body, timeout=60.0)


def test_adapters_load_use_unload_and_load_again_under_8_clients(server, client, folders):
    prompt, n = "The for statement", 6
    want = {name: expected_text(folders, name, prompt, n) for name in ("sql", "poem")}
    want["tiny"] = expected_text(folders, None, prompt, n)
    want["third"] = peft_greedy(folders, "third", prompt, n)
    engine = server.state.engine.loop.engine
    graphs = engine.graph_count()
    stop, failures, done = threading.Event(), [], []

    def ask(name: str):
        start = time.monotonic()
        r = client.completions.create(
            model=name, prompt=prompt, max_tokens=n, temperature=0.0, extra_body={"ignore_eos": True}
        )
        return r.choices[0].text, r.choices[0].finish_reason, time.monotonic() - start

    def background(i: int):
        name = ("tiny", "sql", "poem")[i % 3]
        while not stop.is_set():
            try:
                text, reason, _ = ask(name)
                if (text, reason) != (want[name], "length"):
                    failures.append((name, text, reason))
                done.append(name)
            except Exception as err:  # noqa: BLE001 - every failure is reported below
                failures.append((name, repr(err)))

    # one request before the threads: the client's first call imports modules lazily, which 7 threads doing
    # at once can see half-initialised (a client-side import race, not the server's)
    assert ask("tiny")[:2] == (want["tiny"], "length")
    threads = [threading.Thread(target=background, args=(i,)) for i in range(7)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 300  # generous: 7 short answers; only a stuck server reaches it
        while len(done) < 7 and time.monotonic() < deadline and not failures:
            time.sleep(0.01)
        assert len(done) >= 7, f"the 7 clients had {len(done)} answers, not 7, within 300 s: {failures[:3]}"
        for _ in range(2):  # load, use (an 8th client), unload while its row runs, then again
            r = post(server, "/v1/load_lora_adapter", {"lora_name": "third", "lora_path": folders["third"]})
            assert r.status_code == 200, r.text
            assert "third" in {m.id for m in client.models.list().data}
            assert ask("third")[:2] == (want["third"], "length")
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                running = pool.submit(ask, "third")
                deadline = time.monotonic() + 120
                while not server.state.engine.uses_adapter("third") and not running.done():
                    assert time.monotonic() < deadline, "the 8th client's request was never queued within 120 s"
                    time.sleep(0.002)  # its row is queued or running: the unload below must wait for it
                r = post(server, "/v1/unload_lora_adapter", {"lora_name": "third"})
                assert r.status_code == 200, r.text
                assert running.result()[:2] == (want["third"], "length")  # its row ran to its end on its adapter
            assert "third" not in {m.id for m in client.models.list().data}
            with pytest.raises(openai.NotFoundError):
                ask("third")
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    assert not failures, failures[:3]
    assert engine.graph_count() == graphs, "loading or unloading an adapter compiled a graph"


def test_runtime_adapter_refusals(server, folders, tmp_path):
    root = str(Path(folders["base"]).parent)
    outside = post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)})
    assert outside.status_code == 403 and "outside --lora-root" in outside.json()["error"]["message"]
    wide = post(server, "/v1/load_lora_adapter", {"lora_name": "wide", "lora_path": folders["wide"]})
    assert wide.status_code == 400 and "rank 32" in wide.json()["error"]["message"]
    again = post(server, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": folders["sql"]})
    assert again.status_code == 409 and "already loaded" in again.json()["error"]["message"]
    assert (
        post(server, "/v1/load_lora_adapter", {"lora_name": "third", "lora_path": folders["third"]}).status_code == 200
    )
    try:
        full = post(server, "/v1/load_lora_adapter", {"lora_name": "fourth", "lora_path": folders["third"]})
        assert full.status_code == 409 and "bank is full (3 adapters, --max-loras)" in full.json()["error"]["message"]
    finally:
        assert post(server, "/v1/unload_lora_adapter", {"lora_name": "third"}).status_code == 200
    unknown = post(server, "/v1/unload_lora_adapter", {"lora_name": "nope"})
    assert unknown.status_code == 404
    assert root and post(server, "/v1/load_lora_adapter", {"lora_name": ""}).status_code == 400


def test_runtime_adapter_routes_are_behind_the_api_key_and_off_by_default(folders):
    from staticformers.serving.app import Guard
    from staticformers.serving.state import ServerState

    state = ServerState("tiny", None, None, None, 64, 1, api_key="k")
    scope = {"type": "http", "path": "/v1/load_lora_adapter", "headers": []}
    assert Guard(None, state).refusal(scope).status_code == 401
    opts = ServeOptions(
        model=folders["base"], served_model_name="tiny", backend="eager", max_batch_size=1, max_model_len=32
    )
    model, tok = load(opts)
    s = Server(build_state(model, tok, build_loop(model, opts), opts), grace=1.0)
    s.start()
    try:
        r = post(s, "/v1/load_lora_adapter", {"lora_name": "third", "lora_path": folders["third"]})
        assert r.status_code == 400 and "--enable-lora-runtime-updates" in r.json()["error"]["message"]
    finally:
        s.stop()


def test_max_lora_rank_and_max_loras_below_the_adapters_are_refused(folders):
    """--max-lora-rank 2 with a rank-8 adapter (it was raised to 8 silently), --max-loras 1 with two adapters."""
    opts = ServeOptions(
        model=folders["base"], lora_modules={"sql": folders["sql"], "poem": folders["poem"]}, max_lora_rank=2
    )
    with pytest.raises(
        ValueError,
        match=r"^--max-lora-rank 2 is less than the rank 8 of adapter 'poem' \(.*poem\): "
        r"pass --max-lora-rank 8 or more, or leave it out\.$",
    ):
        load(opts)
    opts.max_lora_rank, opts.max_loras = None, 1
    with pytest.raises(
        ValueError,
        match=r"^--max-loras 1 is less than the 2 adapters of --lora-modules: pass "
        r"--max-loras 2 or more",
    ):
        load(opts)
