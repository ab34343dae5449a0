"""`staticformers serve --device xla --precompile` answers the official openai client (one request, one
stream, 8 concurrent) with the CPU's greedy text, and its compile count does not move after start."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("torch_xla", reason="torch_xla is not installed here: `make test-xla` runs these in its own venv")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import torch  # noqa: E402

from staticformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

LIMIT = 300.0


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    from tiny import save_served

    return save_served("qwen3", tmp_path_factory.mktemp("served_xla"), positions=64)


def cpu_greedy(folder: str, prompt: str, n: int) -> str:
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    ids = tok(prompt)["input_ids"]
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, disable_compile=True
    )
    return tok.decode(out[0, len(ids) :], skip_special_tokens=True)


def graphs_compiled(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return float(re.search(r"^staticformers:graphs_compiled_total\S* (\S+)$", text, re.M).group(1))


def test_serve_on_xla_answers_the_openai_client(folder):
    argv = [
        sys.executable,
        "-m",
        "staticformers",
        "serve",
        folder,
        "--device",
        "xla",
        "--precompile",
        "--port",
        "0",
        "--max-batch-size",
        "2",
        "--max-model-len",
        "32",
        "--served-model-name",
        "tiny",
        "--grace",
        "5",
    ]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        start_new_session=True,
    )
    lines, found = [], threading.Event()
    url = []

    def read():
        for line in proc.stdout:
            lines.append(line)
            m = re.search(r"serving .* on (http://\S+)", line)
            if m and not url:
                url.append(m.group(1))
                found.set()
        found.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert found.wait(LIMIT) and url, "the server did not start:\n" + "".join(lines)
        base = url[0]
        started = graphs_compiled(base)
        assert started > 0  # the plan, compiled before serving
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=LIMIT)
        prompts = ["for x in", "while True", "class A", "def f(", "import", "x = 1", "if a", "return"]
        want = {p: cpu_greedy(folder, p, 6) for p in prompts}

        def ask(prompt):
            r = client.completions.create(
                model="tiny", prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
            )
            return r.choices[0].text

        assert ask(prompts[0]) == want[prompts[0]]
        stream = client.completions.create(
            model="tiny", prompt=prompts[1], max_tokens=6, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        assert "".join(c.choices[0].text for c in stream) == want[prompts[1]]
        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(ask, prompts)) == [want[p] for p in prompts]
        assert graphs_compiled(base) == started, "".join(lines[-40:])
    finally:
        proc.kill()
        proc.wait(timeout=60)
