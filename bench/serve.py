"""Serving benchmark: `staticformers serve` against transformers' continuous batching and sequential
`generate()`, the same requests in the same run.

The workload is fixed by a seed: `--requests` completions of mixed prompt lengths (half to all of
`--prompt` tokens) and mixed answer lengths (half to all of `--new`), greedy, EOS ignored. For each
number of concurrent clients (`--clients`), every request is sent once, each client streaming one
request at a time:

- **sf_server**: our server in its own process (`python -m staticformers serve`, `--max-batch-size` =
  the largest client count, `--max-model-len` fitting the workload), driven over HTTP by asyncio
  clients in this process; a warm-up pass at every client count first (compiles, excluded);
- **hf_cb**: transformers' `ContinuousBatchingManager` (`model.init_continuous_batching`), requests
  added by client threads, tokens streamed back;
- **sequential**: our `model.generate()` one request after another (what a script without a server
  does; its tokens/s does not depend on the client count).

With `--structured`, the server serves the same weights with a byte-level BPE of the model's vocabulary
size (the word-level one has no JSON characters), and every client count runs twice, alternately:
**sf_server** unconstrained and **sf_structured** with a JSON schema on every request
(`response_format` json_schema); reported then: their tokens/s ratio at the largest client count, and
the grammar mask's host time per step and its share of the wall time (the server's
`staticformers:structured_mask_seconds` and `..._steps`, read before and after).

Reported per contender and client count: output tokens/s, time to first token p50/p99, inter-token
latency p50/p99, and wall time; then the ratios the serving issue targets (at the largest client count
ours against hf_cb and against sequential; at 1 client our TTFT against a bare `generate()`'s, i.e.
`generate(max_new_tokens=1)` on the same prompts). The CPU pressure is recorded before and after.

    python bench/serve.py --device cpu --clients 1 4 8 16 --out bench/results/serve.json

`--workload shared-prefix` and `--workload long-prompt` run the prefix-caching and chunked-prefill
workloads instead (`serve_workloads.py`: our server with and without the feature, same requests);
`--workload capacity` runs static against block KV caches in the same memory (`kv_capacity.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import kv_capacity  # noqa: E402
from reference import report  # noqa: E402


def percentile(values: list, q: float):
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def summary(ttft: list, itl: list, tokens: int, wall: float) -> dict:
    return {
        "output_tokens_per_s": round(tokens / wall, 2),
        "wall_s": round(wall, 3),
        "output_tokens": tokens,
        "ttft_ms_p50": _ms(percentile(ttft, 0.5)),
        "ttft_ms_p99": _ms(percentile(ttft, 0.99)),
        "itl_ms_p50": _ms(percentile(itl, 0.5)),
        "itl_ms_p99": _ms(percentile(itl, 0.99)),
    }


def _ms(x):
    return None if x is None else round(x * 1000, 2)


def ensure_tokenizer(folder: str, vocab: int) -> None:
    """A word-level tokenizer of the model's vocabulary size (ids <-> 'w<id>' words) for the synthetic
    reference checkpoint, which has none: the server detokenises what it streams."""
    path = os.path.join(folder, "tokenizer.json")
    if os.path.exists(path):
        return
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(path)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20}, f)


def workload(n: int, prompt: int, new: int, vocab: int, seed: int = 0) -> list:
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(max(1, prompt // 2), prompt + 1, (1,), generator=g))
        answer = int(torch.randint(max(1, new // 2), new + 1, (1,), generator=g))
        out.append((torch.randint(1, vocab, (length,), generator=g).tolist(), answer))
    return out


# ---------------------------------------------------------------------------------------------
# ours, over HTTP
# ---------------------------------------------------------------------------------------------
class ServerProcess:
    def __init__(self, folder: str, device: str, slots: int, max_model_len: int, extra: list):
        argv = [
            sys.executable,
            "-m",
            "staticformers",
            "serve",
            folder,
            "--port",
            "0",
            "--device",
            device,
            "--max-batch-size",
            str(slots),
            "--max-model-len",
            str(max_model_len),
            "--served-model-name",
            "ref",
            "--grace",
            "5",
            *extra,
        ]
        self.argv = argv  # the exact command, for the results
        # in this process's group: a caller that stops this benchmark's group (device_check's step limit)
        # stops the server too
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.url, self.lines = None, []
        ready = threading.Event()

        def read():
            for line in self.proc.stdout:
                self.lines.append(line)
                m = re.search(r"serving .* on (http://\S+)", line)
                if m:
                    self.url = m.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        ready.wait(600)
        if self.url is None:
            self.stop()
            raise RuntimeError("the server did not start:\n" + "".join(self.lines[-30:]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def graphs_compiled(url: str) -> float:
    """The server's `staticformers:graphs_compiled_total` (its `/metrics`, summed over its labels): graphs
    compiled or loaded so far."""
    import httpx

    return parse_graphs_compiled(httpx.get(url + "/metrics", timeout=30).text)


def parse_graphs_compiled(text: str) -> float:
    """`staticformers:graphs_compiled_total` in a `/metrics` text, or one sentence saying it is missing."""
    values = re.findall(r"^staticformers:graphs_compiled_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    if not values:
        raise RuntimeError(
            "the server's /metrics has no staticformers:graphs_compiled_total line: "
            "is it a staticformers server of this checkout?"
        )
    return sum(float(v) for v in values)


STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "score": {"type": "number"},
        "done": {"type": "boolean"},
    },
    "required": ["title", "tags", "score", "done"],
}


def mask_time(url: str) -> tuple:
    """(seconds, steps) of the server's grammar-mask filling so far (`/metrics`)."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=30).text
    values = [
        re.search(rf"^staticformers:structured_mask_{k}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
        for k in ("seconds", "steps")
    ]
    return tuple(float(v.group(1)) if v else 0.0 for v in values)


def structured_folder(folder: str, vocab: int) -> str:
    """The reference weights beside a byte-level BPE tokenizer of `vocab` tokens (hard links, built once)."""
    from grammar_libs import byte_level_bpe

    out = folder.rstrip("/") + "-bytes"
    if not os.path.exists(os.path.join(out, "tokenizer.json")):
        os.makedirs(out, exist_ok=True)
        for name in os.listdir(folder):
            if not name.startswith("tokenizer") and not os.path.exists(os.path.join(out, name)):
                try:  # the server refuses links that leave the folder: hard links, or copies
                    os.link(os.path.join(folder, name), os.path.join(out, name))
                except OSError:
                    shutil.copy2(os.path.join(folder, name), os.path.join(out, name))
        byte_level_bpe(out, vocab)
    return out


async def http_run(url: str, jobs: list, clients: int, extra: Optional[dict] = None) -> dict:
    import httpx

    queue: asyncio.Queue = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)
    ttft, itl, tokens = [], [], [0]

    async def client(c):
        while True:
            try:
                prompt, new = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            body = {
                "model": "ref",
                "prompt": prompt,
                "max_tokens": new,
                "temperature": 0,
                "stream": True,
                "ignore_eos": True,
                **(extra or {}),
            }
            start = last = time.perf_counter()
            first = True
            async with c.stream("POST", url + "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    now = time.perf_counter()
                    if first:
                        ttft.append(now - start)
                        first = False
                    else:
                        itl.append(now - last)
                    last = now
                    tokens[0] += 1

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients + 4)) as c:
        start = time.perf_counter()
        await asyncio.gather(*[client(c) for _ in range(clients)])
        wall = time.perf_counter() - start
    return summary(ttft, itl, tokens[0], wall)


# ---------------------------------------------------------------------------------------------
# the peers, in this process
# ---------------------------------------------------------------------------------------------
def hf_manager(model, jobs: list):
    """transformers' continuous-batching manager, started (one for every client count)."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max(n for _, n in jobs), do_sample=False, eos_token_id=-1, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    return manager


def hf_cb_run(manager, jobs: list, clients: int) -> dict:
    """transformers' continuous batching: client threads add streaming requests and read their tokens."""
    lock = threading.Lock()
    pending = list(jobs)
    ttft, itl, tokens = [], [], [0]

    def client(i):
        while True:
            with lock:
                if not pending:
                    return
                prompt, new = pending.pop(0)
            start = last = time.perf_counter()
            seen = 0
            rid = manager.add_request(prompt, max_new_tokens=new, streaming=True)
            for out in manager.request_id_iter(rid):
                now = time.perf_counter()
                count = len(out.generated_tokens)
                if count > seen:
                    if seen == 0:
                        ttft.append(now - start)
                    else:
                        itl.append((now - last) / (count - seen))
                    last, seen = now, count
                if out.is_finished():
                    break
            with lock:
                tokens[0] += seen

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    return summary(ttft, itl, tokens[0], wall)


def sequential_run(model, jobs: list, compile_config=None) -> dict:
    import torch

    ttft, tokens = [], 0
    start = time.perf_counter()
    for prompt, new in jobs:
        t = time.perf_counter()
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=new,
            do_sample=False,
            eos_token_id=None,
            compile_config=compile_config,
        )
        tokens += out.shape[1] - len(prompt)
        ttft.append(time.perf_counter() - t)  # a whole answer: the client sees nothing before
    wall = time.perf_counter() - start
    return summary(ttft, [], tokens, wall)


def bare_ttft(model, jobs: list, compile_config=None) -> float:
    """Median seconds of `generate(max_new_tokens=1)` over the workload's prompts (after one warm pass)."""
    import torch

    for prompt, _ in jobs:
        model.generate(torch.tensor([prompt]), max_new_tokens=1, eos_token_id=None, compile_config=compile_config)
    times = []
    for prompt, _ in jobs:
        t = time.perf_counter()
        model.generate(torch.tensor([prompt]), max_new_tokens=1, eos_token_id=None, compile_config=compile_config)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


# ---------------------------------------------------------------------------------------------
def main(argv=None) -> None:
    import torch

    from reference import build_reference, pressure, reference_config

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--size", default="41m")
    p.add_argument("--dtype", default=None, help="the checkpoint's dtype (default: the size's)")
    p.add_argument("--clients", nargs="+", type=int, default=[1, 4, 8, 16])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt", type=int, default=128, help="longest prompt (tokens)")
    p.add_argument("--new", type=int, default=64, help="longest answer (tokens)")
    p.add_argument("--peers", default="hf_cb,sequential", help="comma-separated: hf_cb, sequential (or none)")
    p.add_argument(
        "--backend",
        default=None,
        help="our compile backend (default: the device's): the server's, and the in-process generate()'s "
        "(bare TTFT, sequential)",
    )
    p.add_argument("--no-compile", action="store_true", help="our steps eagerly (a short time budget)")
    p.add_argument(
        "--structured",
        action="store_true",
        help="also run every client count with a JSON schema on every request (see the docstring)",
    )
    p.add_argument("--rounds", type=int, default=1, help="timed passes per client count (A B, then B A, ...)")
    p.add_argument("--out", default=None)
    p.add_argument("--workload", default="mixed", choices=["mixed", "shared-prefix", "long-prompt", "capacity"])
    p.add_argument("--system", type=int, default=1000, help="shared-prefix: the shared system prompt's tokens")
    p.add_argument(
        "--arms",
        nargs="+",
        default=None,
        choices=["no_cache", "prefix_cache", "shared_blocks"],
        help="shared-prefix: the servers to run (default all three)",
    )
    p.add_argument("--long", type=int, default=2000, help="long-prompt: the long prompt's tokens")
    p.add_argument("--long-delay", type=float, default=1.0, help="long-prompt: seconds before it arrives")
    p.add_argument("--max-model-len", type=int, default=2048, help="shared-prefix, long-prompt, capacity: the servers'")
    p.add_argument("--server-args", default="", help="more `staticformers serve` flags for every server")
    kv_capacity.add_arguments(p)
    args = p.parse_args(argv)
    folder = build_reference(size=args.size, dtype=args.dtype)
    vocab = reference_config(args.size).vocab_size
    ensure_tokenizer(folder, vocab)
    if args.workload != "mixed":
        return run_workload(args, folder, vocab)
    served = structured_folder(folder, vocab) if args.structured else folder
    jobs = workload(args.requests, args.prompt, args.new, vocab)
    slots = max(args.clients)
    max_len = 1 << (args.prompt + args.new - 1).bit_length()
    result = {
        "device": args.device,
        "size": args.size,
        "requests": args.requests,
        "prompt": args.prompt,
        "new": args.new,
        "clients": args.clients,
        "pressure_before": pressure(),
        "sf_server": {},
    }
    peers = [x for x in args.peers.split(",") if x and x != "none"]

    extra = (["--backend", args.backend] if args.backend else []) + (["--no-compile"] if args.no_compile else [])
    server = ServerProcess(served, args.device, slots, max_len, extra)
    constrained = {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "item", "schema": STRUCTURED_SCHEMA, "strict": True},
        }
    }
    try:
        for c in sorted(set(args.clients)):  # warm-up: every shape the runs will meet
            asyncio.run(http_run(server.url, jobs, c))
            if args.structured:
                asyncio.run(http_run(server.url, jobs, c, constrained))
        warm = graphs_compiled(server.url)
        if args.structured:
            result["sf_structured"] = {}
        pairs: dict = {}  # client count -> per round [free tok/s, structured tok/s, mask ms per step]
        for r in range(args.rounds):
            for i, c in enumerate(args.clients):
                order = ["free", "structured"] if (i + r) % 2 == 0 else ["structured", "free"]
                got = {}
                for kind in order if args.structured else ["free"]:
                    if kind == "free":
                        result["sf_server"][str(c)] = got["free"] = asyncio.run(http_run(server.url, jobs, c))
                        print(json.dumps({"sf_server": c, "round": r, **got["free"]}), file=sys.stderr, flush=True)
                        continue
                    before = mask_time(server.url)
                    run = asyncio.run(http_run(server.url, jobs, c, constrained))
                    seconds, steps = (a - b for a, b in zip(mask_time(server.url), before))
                    run["mask_ms_per_step"] = round(1000 * seconds / steps, 3) if steps else None
                    run["mask_steps"] = int(steps)
                    run["mask_share_of_wall"] = round(seconds / run["wall_s"], 4)
                    result["sf_structured"][str(c)] = got["structured"] = run
                    print(json.dumps({"sf_structured": c, "round": r, **run}), file=sys.stderr, flush=True)
                if args.structured:
                    pairs.setdefault(str(c), []).append(
                        [
                            got["free"]["output_tokens_per_s"],
                            got["structured"]["output_tokens_per_s"],
                            got["structured"]["mask_ms_per_step"],
                        ]
                    )
        if args.structured:
            result["structured_rounds"] = pairs
        result["sf_graphs_after_warmup"] = graphs_compiled(server.url) - warm  # 0 expected
    finally:
        server.stop()

    if "hf_cb" in peers:
        try:
            import transformers

            hf = transformers.AutoModelForCausalLM.from_pretrained(folder).to(args.device).eval()
            manager = hf_manager(hf, jobs)
            try:
                for c in sorted(set(args.clients)):  # warm-up, as ours
                    hf_cb_run(manager, jobs, c)
                result["hf_cb"] = {str(c): hf_cb_run(manager, jobs, c) for c in args.clients}
            finally:
                manager.stop(block=True, timeout=30)
            del hf
        except Exception as err:  # the peer not running here is a result too
            result["hf_cb"] = {"error": f"{type(err).__name__}: {err}"[:500]}
    from staticformers import AutoModelForCausalLM, CompileConfig

    ours = AutoModelForCausalLM.from_pretrained(folder, device_map=args.device)
    cc = CompileConfig(backend=args.backend) if args.backend else None  # --backend: the server's and these
    result["bare_generate_ttft_ms"] = round(bare_ttft(ours, jobs[:8], cc) * 1000, 2)
    if "sequential" in peers:
        sequential_run(ours, jobs[:4], cc)  # warm-up
        result["sequential"] = sequential_run(ours, jobs, cc)
    top = str(max(args.clients))
    ratios = {}
    ours_top = result["sf_server"][top]["output_tokens_per_s"]
    if isinstance(result.get("hf_cb"), dict) and top in result["hf_cb"]:
        ratios["throughput_vs_hf_cb_at_max_clients"] = round(ours_top / result["hf_cb"][top]["output_tokens_per_s"], 2)
    if "sequential" in result:
        ratios["throughput_vs_sequential_at_max_clients"] = round(
            ours_top / result["sequential"]["output_tokens_per_s"], 2
        )
    if "sf_structured" in result:  # the median over rounds of each round's ratio
        ratios["structured_vs_free_throughput_at_max_clients"] = round(
            statistics.median(s / f for f, s, _ in result["structured_rounds"][top]), 2
        )
    if "1" in result["sf_server"]:
        ratios["ttft_1_client_vs_bare_generate"] = round(
            result["sf_server"]["1"]["ttft_ms_p50"] / result["bare_generate_ttft_ms"], 2
        )
    result["ratios"] = ratios
    result["pressure_after"] = pressure()
    result["torch"] = torch.__version__
    report(result, args.out)


def run_workload(args, folder: str, vocab: int) -> None:
    """`--workload shared-prefix` / `long-prompt` (`serve_workloads.py`) or `capacity` (`kv_capacity.py`), its JSON
    printed and written."""
    import torch

    import serve_workloads
    from reference import pressure

    base = (
        (["--backend", args.backend] if args.backend else [])
        + (["--no-compile"] if args.no_compile else [])
        + args.server_args.split()
    )

    def server(extra, slots=None):
        return ServerProcess(folder, args.device, slots or max(args.clients), args.max_model_len, base + extra)

    before = pressure()
    run = {
        "shared-prefix": serve_workloads.shared_prefix,
        "long-prompt": serve_workloads.long_prompt,
        "capacity": lambda *a: kv_capacity.capacity(*a, client_run=http_run),
    }[args.workload]
    result = {
        "device": args.device,
        "size": args.size,
        "server_args": base,
        "pressure_before": before,
        **run(server, args, vocab),
        "pressure_after": pressure(),
        "torch": torch.__version__,
    }
    report(result, args.out)


if __name__ == "__main__":
    main()
