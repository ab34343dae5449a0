"""`staticformers serve` as a process: SIGTERM finishes the request in flight and exits 0; under torchrun
with two ranks and `--tensor-parallel-size 2` (gloo), rank 0 serves and the answers equal one process's.
Every server binds 127.0.0.1 on a free port and is stopped by the test, with a hard time limit."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading

import pytest
import torch

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from staticformers import AutoModelForCausalLM, AutoTokenizer, CompileConfig  # noqa: E402

LIMIT = 240.0


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    from tiny import save_served

    return save_served("llama", tmp_path_factory.mktemp("served_process"))


class Process:
    """A server process whose first 'serving ... on http://...' line gives its address."""

    def __init__(self, argv: list[str], env: dict):
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
        )
        self.lines: list[str] = []
        self.url = None
        ready = threading.Event()

        def read():
            for line in self.proc.stdout:
                self.lines.append(line)
                match = re.search(r"serving .* on (http://\S+)", line)
                if match and self.url is None:
                    self.url = match.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(LIMIT) or self.url is None:
            self.kill()
            raise AssertionError("the server did not start:\n" + "".join(self.lines))

    def kill(self) -> None:
        """The process and everything it started (torchrun's ranks included), whatever state they are in."""
        import psutil

        try:
            tree = psutil.Process(self.proc.pid)
            procs = tree.children(recursive=True) + [tree]
        except psutil.NoSuchProcess:
            return
        for proc in procs:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=30)

    def output(self) -> str:
        return "".join(self.lines)


def env() -> dict:
    return dict(os.environ, STATICFORMERS_COMPILE_BACKEND="eager", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


def greedy_text(folder: str, prompt: str, n: int) -> str:
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    ids = tok(prompt)["input_ids"]
    out = model.generate(
        torch.tensor([ids]),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        compile_config=CompileConfig(backend="eager"),
    )
    return tok.decode(out[0, len(ids) :], skip_special_tokens=True)


def test_sigterm_finishes_the_request_in_flight_and_exits_0(folder):
    p = Process(
        [
            sys.executable,
            "-m",
            "staticformers",
            "serve",
            folder,
            "--port",
            "0",
            "--max-batch-size",
            "2",
            "--grace",
            "60",
            "--served-model-name",
            "tiny",
        ],
        env(),
    )
    try:
        body = {
            "model": "tiny",
            "prompt": "for x in",
            "max_tokens": 60,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
        text = []
        with httpx.stream("POST", p.url + "/v1/completions", json=body, timeout=LIMIT) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    text.append(json.loads(line[6:])["choices"][0]["text"])
                    break
            os.kill(p.proc.pid, signal.SIGTERM)  # mid-answer
            for line in lines:
                if line.startswith("data: {"):
                    text.append(json.loads(line[6:])["choices"][0]["text"])
        assert p.proc.wait(timeout=LIMIT) == 0, p.output()
        assert "".join(text) == greedy_text(folder, "for x in", 60)
        # started without --precompile: it said that new shapes compile on the request that needs them
        assert "was not compiled ahead: a request whose shape is new waits while it compiles" in p.output()
        with pytest.raises(httpx.HTTPError):
            httpx.get(p.url + "/health", timeout=5)
    finally:
        p.kill()


def test_bad_flags_are_one_sentence(folder):
    out = subprocess.run(
        [sys.executable, "-m", "staticformers", "serve", folder, "--tensor-parallel-size", "2"],
        capture_output=True,
        text=True,
        timeout=LIMIT,
        env=env(),
    )
    assert out.returncode == 2 and "--tensor-parallel-size 2 needs as many processes, but 1 is running" in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "staticformers", "serve", folder, "--port", "99999"],
        capture_output=True,
        text=True,
        timeout=LIMIT,
        env=env(),
    )
    assert out.returncode == 2 and "99999 is not a port number" in out.stderr


@pytest.mark.distributed
@pytest.mark.slow
def test_tensor_parallel_serving_under_torchrun(folder):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone"]
    p = Process(
        torchrun
        + [
            "-m",
            "staticformers",
            "serve",
            folder,
            "--port",
            "0",
            "--tensor-parallel-size",
            "2",
            "--no-compile",
            "--served-model-name",
            "tiny",
            "--grace",
            "10",
        ],
        env(),
    )
    try:
        prompts = ["for x in", "while True", "class A"]
        with httpx.Client(timeout=LIMIT) as c:
            for prompt in prompts:
                r = c.post(
                    p.url + "/v1/completions",
                    json={"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True},
                )
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == greedy_text(folder, prompt, 8), prompt
        import psutil

        ranks = {int(c.environ().get("RANK", -1)): c for c in psutil.Process(p.proc.pid).children()}
        ranks[0].send_signal(signal.SIGTERM)  # rank 0 drains, then tells rank 1 to stop
        assert p.proc.wait(timeout=LIMIT) == 0, p.output()
    finally:
        p.kill()
