"""Soak test of the server: many clients, mixed and hostile requests, for minutes; then the server must
still be whole.

`python -m staticformers serve` runs in its own process on a small random Qwen3 (built once into a
temporary folder, a word-level tokenizer with a chat template; EOS is a word the model does emit, so
answers end on their first token now and then). `--clients` asyncio clients send requests for
`--seconds`, each drawing what to send next from a fixed mix (seeded):

- completions and chat, whole and streamed, `max_tokens` from 1 to 32 (`max_tokens=1` among them),
  sampled or greedy, `n` up to 2;
- greedy completions of eight known prompts, whose text must equal `generate()`'s (computed here,
  before the soak, in this process): batch neighbours must never change an answer;
- streams the client leaves after a few chunks, and whole requests it abandons after a short wait;
- bad bodies: not JSON, a field that would change the answer, a lone surrogate, JSON nested too deep,
  a wrong type, a prompt past `--max-model-len`.

What must hold, printed as JSON with the counts: no 5xx for any well-formed request; every bad body a
4xx in OpenAI's error format; every stream that was read to its end ends with `[DONE]`; every known
greedy answer right; and after the soak no request running or waiting (`/metrics`), the known answers
still right, `/health` 200. The CPU pressure is recorded before and after. Not part of `make test`.

    nice -n 5 python bench/soak.py --seconds 180 --clients 16 --out bench/results/soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from reference import pressure  # noqa: E402
from serve import ServerProcess  # noqa: E402

VOCAB = 512
EOS = 7  # "w7": a word the random model emits now and then
CHAT_TEMPLATE = "{% for m in messages %}w2 {{ m.content }} w3 {% endfor %}{% if add_generation_prompt %}w4 {% endif %}"


def build_model(folder: str) -> None:
    """A small random Qwen3 (2 layers, hidden 128) and a word-level tokenizer ('w<id>' words) with a chat
    template and EOS 'w7'."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from staticformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3",
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        eos_token_id=EOS,
        tie_word_embeddings=True,
    )
    AutoModelForCausalLM.from_config(config, seed=0).save_pretrained(folder)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": 512,
                "eos_token": f"w{EOS}",
                "chat_template": CHAT_TEMPLATE,
            },
            f,
        )


def words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(8, VOCAB)}" for _ in range(n))


def known_answers(folder: str, count: int = 8, new: int = 12) -> list:
    """(prompt, greedy text of `new` tokens, EOS ignored) for `count` fixed prompts, by `generate()`."""
    import torch

    from staticformers import AutoModelForCausalLM, AutoTokenizer, CompileConfig

    model = AutoModelForCausalLM.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    rng = random.Random(1)
    out = []
    for _ in range(count):
        prompt = words(rng, rng.randint(2, 40))
        ids = tok(prompt)["input_ids"]
        got = model.generate(
            torch.tensor([ids]),
            max_new_tokens=new,
            do_sample=False,
            eos_token_id=None,
            compile_config=CompileConfig(backend="eager"),
        )
        out.append((prompt, tok.decode(got[0, len(ids) :], skip_special_tokens=True)))
    return out


BAD_BODIES = [
    ("not json", b"{nope"),
    ("unknown field", json.dumps({"model": "soak", "prompt": "w9", "guided_json": {"type": "object"}}).encode()),
    ("lone surrogate", b'{"model": "soak", "prompt": "\\ud800"}'),
    ("nested too deep", b"[" * 200 + b"]" * 200),
    ("wrong type", json.dumps({"model": "soak", "prompt": "w9", "max_tokens": "ten"}).encode()),
    ("too long", json.dumps({"model": "soak", "prompt": "w9 " * 600}).encode()),
    ("n never fits", json.dumps({"model": "soak", "prompt": "w9", "n": 99}).encode()),
]


class Tally:
    def __init__(self):
        self.counts: dict = {}
        self.failures: list = []

    def add(self, kind: str, outcome: str) -> None:
        self.counts.setdefault(kind, {}).setdefault(outcome, 0)
        self.counts[kind][outcome] += 1

    def fail(self, kind: str, what: str) -> None:
        self.add(kind, "FAILED")
        if len(self.failures) < 20:
            self.failures.append(f"{kind}: {what}")


async def one(client, url: str, rng: random.Random, known: list, tally: Tally) -> None:
    """Send one request of the mix and check what came back."""
    draw = rng.random()
    if draw < 0.12:  # a bad body
        name, body = BAD_BODIES[rng.randrange(len(BAD_BODIES))]
        r = await client.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"})
        error = r.json().get("error", {}) if r.headers.get("content-type", "").startswith("application/json") else {}
        if 400 <= r.status_code < 500 and set(error) == {"message", "type", "param", "code"}:
            tally.add("bad body", str(r.status_code))
        else:
            tally.fail("bad body", f"{name}: {r.status_code} {r.text[:200]}")
        return
    if draw < 0.30:  # a known greedy answer
        prompt, want = known[rng.randrange(len(known))]
        r = await client.post(
            url + "/v1/completions",
            json={"model": "soak", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True},
        )
        if r.status_code != 200:
            tally.fail("known answer", f"{r.status_code} {r.text[:200]}")
        elif r.json()["choices"][0]["text"] != want:
            tally.fail("known answer", f"{prompt!r}: {r.json()['choices'][0]['text']!r} != {want!r}")
        else:
            tally.add("known answer", "right")
        return
    chat = draw < 0.50
    path = "/v1/chat/completions" if chat else "/v1/completions"
    max_tokens = 1 if rng.random() < 0.2 else rng.randint(2, 32)
    body = {
        "model": "soak",
        "max_tokens": max_tokens,
        "temperature": rng.choice([0, 0.8]),
        "n": rng.choice([1, 1, 1, 2]),
        "seed": rng.randrange(1000),
    }
    if chat:
        body["messages"] = [{"role": "user", "content": words(rng, rng.randint(1, 30))}]
    else:
        body["prompt"] = words(rng, rng.randint(1, 60))
    stream = rng.random() < 0.5
    leave = rng.random() < 0.25  # the client goes away
    kind = f"{'chat' if chat else 'completion'} {'stream' if stream else 'whole'}{' left' if leave else ''}"
    if stream:
        body["stream"] = True
        async with client.stream("POST", url + path, json=body) as r:
            if r.status_code != 200:
                tally.fail(kind, f"{r.status_code} {(await r.aread())[:200]!r}")
                return
            lines = []
            async for line in r.aiter_lines():
                if line:
                    lines.append(line)
                if leave and len(lines) >= 2:
                    tally.add(kind, "left")
                    return
            if lines and lines[-1] == "data: [DONE]" and not any('"error"' in x for x in lines):
                tally.add(kind, "done")
            else:
                tally.fail(kind, f"ended with {lines[-2:]}")
        return
    if leave:
        try:
            await asyncio.wait_for(client.post(url + path, json={**body, "max_tokens": 32}), timeout=0.05)
            tally.add(kind, "finished first")
        except asyncio.TimeoutError:
            tally.add(kind, "left")
        return
    r = await client.post(url + path, json=body)
    if r.status_code == 200 and all(c["finish_reason"] in ("stop", "length") for c in r.json()["choices"]):
        tally.add(kind, "200")
    elif r.status_code == 429:
        tally.add(kind, "429")
    else:
        tally.fail(kind, f"{r.status_code} {r.text[:200]}")


async def soak(url: str, seconds: float, clients: int, known: list, seed: int) -> Tally:
    import httpx

    tally = Tally()
    deadline = time.monotonic() + seconds

    async def client_loop(i: int):
        rng = random.Random(seed * 1000 + i)
        async with httpx.AsyncClient(timeout=120) as client:
            while time.monotonic() < deadline:
                try:
                    await one(client, url, rng, known, tally)
                except (httpx.HTTPError, ValueError) as err:
                    tally.fail("transport", repr(err)[:200])

    await asyncio.gather(*[client_loop(i) for i in range(clients)])
    return tally


def after(url: str, known: list) -> dict:
    """The server once the soak is over: nothing running or waiting, the known answers right, healthy."""
    import httpx

    deadline = time.monotonic() + 30
    while True:
        text = httpx.get(url + "/metrics", timeout=30).text
        running = sum(float(v) for v in re.findall(r"^staticformers:num_requests_running\{[^}]*\} (\S+)$", text, re.M))
        waiting = sum(float(v) for v in re.findall(r"^staticformers:num_requests_waiting\{[^}]*\} (\S+)$", text, re.M))
        if (running == 0 and waiting == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    wrong = 0
    for prompt, want in known:
        r = httpx.post(
            url + "/v1/completions",
            json={"model": "soak", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True},
            timeout=60,
        )
        wrong += r.status_code != 200 or r.json()["choices"][0]["text"] != want
    return {
        "running": running,
        "waiting": waiting,
        "known_answers_wrong": wrong,
        "health": httpx.get(url + "/health", timeout=30).status_code,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=180.0)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    before = pressure()
    with tempfile.TemporaryDirectory() as folder:
        build_model(folder)
        known = known_answers(folder)
        server = ServerProcess(
            folder, "cpu", 8, 512, ["--no-compile", "--served-model-name", "soak", "--max-queued-requests", "64"]
        )
        try:
            url = server.url
            started = time.monotonic()
            tally = asyncio.run(soak(url, args.seconds, args.clients, known, args.seed))
            wall = time.monotonic() - started
            state = after(url, known)
        finally:
            server.stop()
        log = "".join(server.lines)
    requests = sum(sum(v.values()) for v in tally.counts.values())
    failed = sum(v.get("FAILED", 0) for v in tally.counts.values())
    ok = (
        failed == 0
        and state["running"] == 0
        and state["waiting"] == 0
        and state["known_answers_wrong"] == 0
        and state["health"] == 200
        and server.proc.returncode == 0
    )
    result = {
        "seconds": round(wall, 1),
        "clients": args.clients,
        "requests": requests,
        "requests_per_s": round(requests / wall, 2),
        "failed": failed,
        "failures": tally.failures,
        "outcomes": tally.counts,
        "after": state,
        "exit_code": server.proc.returncode,
        "server_log_lines": len(log.splitlines()),
        "tracebacks_in_log": log.count("Traceback"),
        "pressure_before": before,
        "pressure_after": pressure(),
        "ok": ok,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
