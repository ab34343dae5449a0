"""The KV-capacity workload (`bench/serve.py --workload capacity`): how many more requests block KV caches run
at once than static caches in the same memory, and what that does to throughput (issue 41's capacity target).

Why it exists: a static cache gives every running request a whole row of `--max-model-len` positions in every
layer, so a budget of R rows runs R requests however short they are; a pool of blocks holds only the blocks each
request's tokens fill, so on a long-tail mix of lengths the same bytes run many more requests at once.

- **Budget**: what static caches for `--budget-rows` (16) rows of `--max-model-len`
  (2048) allocate (`KVCache.bytes_for`, from the model's config and the served dtype) divided by
  `--budget-divisor` (8), i.e. 2 such rows.
- **Requests** (`--requests`, fixed by `--seed`): prompt lengths lognormal (median `--prompt-median`, sigma
  `--prompt-sigma`) clipped to [`--prompt-min`, `--prompt-max`]: most short, a few long; answers uniform in
  [`--new-min`, `--new-max`], each prompt + answer within max_model_len; greedy, EOS ignored, streamed by
  `--clients` clients (16), each one request at a time.
- **Servers**, the same requests: **static** (`--max-batch-size` the rows the budget holds,
  `--enable-chunked-prefill`) and **blocks** (`--max-batch-size` the clients, `--kv-cache-memory-bytes` the
  budget, `--block-size`), both alive at once, one idle while the other runs.
- Each server runs a warm-up pass first (compiles, excluded), then `--rounds` timed passes, the servers
  alternating which goes first. During a timed pass `/metrics` is sampled every `--sample-interval` s (0.2):
  requests running (max, mean, p50) and waiting, KV usage (peak; the gauge counts a block pool only, so the
  static server's stays 0), and the preemptions counter's delta.

Reported per server: every round (output tokens/s, TTFT and ITL p50/p99, wall time, the samples' summary,
graphs compiled during the pass, CPU pressure around it) and their median; the ratios blocks / static of the
max and mean running and of the output tokens/s (the median of each round's ratio); the budget in bytes and in
blocks, the length distribution, and the exact commands.

    python bench/serve.py --workload capacity --clients 16 --requests 128 --rounds 4 --out FILE
"""

from __future__ import annotations

import asyncio
import math
import random
import re
import shlex
import statistics
import sys
import time
from types import SimpleNamespace

METRICS = (
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "num_preemptions_total",
    "graphs_compiled_total",
)


def add_arguments(p) -> None:
    """The workload's flags on `bench/serve.py`'s parser."""
    g = p.add_argument_group("capacity workload")
    g.add_argument("--seed", type=int, default=0, help="capacity: the requests' seed")
    g.add_argument("--prompt-min", type=int, default=16, help="capacity: shortest prompt (tokens)")
    g.add_argument("--prompt-max", type=int, default=1800, help="capacity: longest prompt (tokens)")
    g.add_argument("--prompt-median", type=float, default=96.0, help="capacity: the lognormal's median (tokens)")
    g.add_argument("--prompt-sigma", type=float, default=1.2, help="capacity: the lognormal's sigma (of log tokens)")
    g.add_argument("--new-min", type=int, default=16, help="capacity: shortest answer (tokens)")
    g.add_argument("--new-max", type=int, default=128, help="capacity: longest answer (tokens)")
    g.add_argument("--budget-rows", type=int, default=16, help="capacity: static rows the budget is a share of")
    g.add_argument("--budget-divisor", type=int, default=8, help="capacity: the budget is those rows' bytes over this")
    g.add_argument("--block-size", type=int, default=32, help="capacity: the blocks server's --block-size")
    g.add_argument("--sample-interval", type=float, default=0.2, help="capacity: seconds between /metrics samples")
    g.add_argument(
        "--warmup-requests",
        type=int,
        default=0,
        help="capacity: the warm-up pass's requests, the first of the workload's (default 0: all of them)",
    )


# ---------------------------------------------------------------------------------------------
# the pure parts: lengths, budget, metrics
# ---------------------------------------------------------------------------------------------
def long_tail_lengths(n: int, lo: int, hi: int, median: float, sigma: float, rng: random.Random) -> list:
    """`n` lengths drawn lognormal (median `median`, sigma `sigma` of the log), rounded and clipped to [lo, hi]."""
    if not 1 <= lo <= hi:
        raise ValueError(f"the length bounds [{lo}, {hi}] are not 1 <= lo <= hi.")
    return [min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]


def capacity_jobs(n: int, vocab: int, seed: int, prompt: tuple, new: tuple, max_model_len: int) -> list:
    """`n` requests `(prompt ids, answer tokens)`: prompt lengths `long_tail_lengths(n, *prompt)` (prompt = lo, hi,
    median, sigma), answers uniform in `new` = (lo, hi) and cut to fit `max_model_len` with their prompt."""
    lo, hi = new
    if prompt[1] >= max_model_len or not 1 <= lo <= hi:
        raise ValueError(
            f"prompts up to {prompt[1]} tokens and answers of [{lo}, {hi}] do not fit "
            f"--max-model-len {max_model_len}: lower --prompt-max or fix the answer bounds."
        )
    rng = random.Random(seed)
    lengths = long_tail_lengths(n, *prompt, rng)
    jobs = []
    for length in lengths:
        answer = min(rng.randint(lo, hi), max_model_len - length)
        jobs.append(([rng.randrange(1, vocab) for _ in range(length)], answer))
    return jobs


def length_summary(jobs: list) -> dict:
    """The workload's prompt and answer lengths at a glance."""
    prompts = sorted(len(p) for p, _ in jobs)

    def q(x):
        return prompts[min(len(prompts) - 1, int(round(x * (len(prompts) - 1))))]

    return {
        "prompt_p50": q(0.5),
        "prompt_p90": q(0.9),
        "prompt_p99": q(0.99),
        "prompt_max": prompts[-1],
        "prompt_mean": round(statistics.mean(prompts), 1),
        "prompts_over_512": sum(p > 512 for p in prompts),
        "new_mean": round(statistics.mean(n for _, n in jobs), 1),
        "output_tokens": sum(n for _, n in jobs),
    }


def kv_budget(config, dtype, rows: int, max_model_len: int, divisor: int, block_size: int) -> dict:
    """The capacity budget, as the library computes it: the bytes of `KVCache.bytes_for(model, rows, max_model_len)`
    over `divisor`; the static rows of `max_model_len` it holds, and the usable blocks of `block_size` positions
    (`KVBlocks.blocks_in`, the pool's null block counted against it)."""
    from staticformers.models.block_kv_cache import KVBlocks
    from staticformers.models.kv_cache import KVCache

    model = SimpleNamespace(config=config, dtype=dtype)  # all that bytes_for and blocks_in read
    total = KVCache.bytes_for(model, rows, max_model_len) // divisor
    per_row = KVCache.bytes_for(model, 1, max_model_len)
    if total < per_row:
        raise ValueError(
            f"a budget of {total} bytes holds no static row of {max_model_len} positions "
            f"({per_row} bytes): lower --budget-divisor."
        )
    blocks = KVBlocks.blocks_in(model, total, block_size)
    return {
        "bytes": total,
        "mib": round(total / 2**20, 3),
        "bytes_per_position": per_row // max_model_len,
        "static_rows": total // per_row,
        "blocks": blocks,
        "block_size": block_size,
        "block_positions": blocks * block_size,
        "of": f"{rows} rows x {max_model_len} positions / {divisor}",
        "dtype": str(dtype).removeprefix("torch."),
    }


def parse_metrics(text: str) -> dict:
    """The capacity gauges and counters (`METRICS`) from a `/metrics` text, each summed over its labels; a name
    that is missing is absent from the result."""
    out = {}
    for name in METRICS:
        values = re.findall(rf"^staticformers:{name}\{{[^}}]*\}} (\S+)$", text, re.M)
        if values:
            out[name] = sum(float(v) for v in values)
    return out


def sample_summary(samples: list, before: dict, after: dict) -> dict:
    """What the `/metrics` samples of one pass say: requests running (max, mean, p50) and waiting (max, mean), the
    KV pool's peak usage, the preemptions and graphs compiled during the pass (`after - before`)."""

    def column(name):
        return [s[name] for s in samples if name in s]

    running, waiting, usage = (
        column("num_requests_running"),
        column("num_requests_waiting"),
        column("kv_cache_usage_perc"),
    )

    def delta(name):
        return int(after[name] - before[name]) if name in after and name in before else None

    return {
        "samples": len(samples),
        "running_max": max(running, default=None),
        "running_mean": round(statistics.mean(running), 2) if running else None,
        "running_p50": statistics.median(running) if running else None,
        "waiting_max": max(waiting, default=None),
        "waiting_mean": round(statistics.mean(waiting), 2) if waiting else None,
        "kv_cache_usage_peak": round(max(usage), 4) if usage else None,
        "preemptions": delta("num_preemptions_total"),
        "graphs_compiled": delta("graphs_compiled_total"),
    }


def server_flags(budget: dict, clients: int) -> dict:
    """{server: (--max-batch-size, the other `staticformers serve` flags)} of the two servers at the budget."""
    return {
        "static": (budget["static_rows"], ["--enable-chunked-prefill"]),
        "blocks": (
            clients,
            ["--kv-cache-memory-bytes", str(budget["bytes"]), "--block-size", str(budget["block_size"])],
        ),
    }


def ratios(rounds: list) -> dict:
    """blocks / static of max and mean running and of output tokens/s: the median of each round's ratio."""

    def median_ratio(key):
        values = [
            r["blocks"][key] / r["static"][key]
            for r in rounds
            if r["static"].get(key) and r["blocks"].get(key) is not None
        ]
        return round(statistics.median(values), 3) if values else None

    return {
        "running_max_blocks_over_static": median_ratio("running_max"),
        "running_mean_blocks_over_static": median_ratio("running_mean"),
        "output_tokens_per_s_blocks_over_static": median_ratio("output_tokens_per_s"),
    }


def medians(runs: list) -> dict:
    """The element-wise median of the rounds' numbers."""
    keys = [k for k, v in runs[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return {
        k: round(statistics.median(r[k] for r in runs if r.get(k) is not None), 3)
        for k in keys
        if any(r.get(k) is not None for r in runs)
    }


# ---------------------------------------------------------------------------------------------
# the passes, over HTTP
# ---------------------------------------------------------------------------------------------
async def metrics_now(client, url: str) -> dict:
    return parse_metrics((await client.get(url + "/metrics")).text)


async def sampled_pass(url: str, jobs: list, clients: int, interval: float, client_run) -> dict:
    """One pass of `jobs` by `clients` clients (`client_run`, serve.py's `http_run`) while `/metrics` is sampled
    every `interval` seconds; its summary and the samples'."""
    import httpx

    from reference import pressure

    async with httpx.AsyncClient(timeout=30) as c:
        before, press = await metrics_now(c, url), pressure()
        samples: list = []
        done = asyncio.Event()

        async def sample():
            while not done.is_set():
                samples.append(await metrics_now(c, url))
                try:
                    await asyncio.wait_for(done.wait(), interval)
                except asyncio.TimeoutError:
                    pass

        sampler = asyncio.create_task(sample())
        try:
            run = await client_run(url, jobs, clients)
        finally:
            done.set()
            await sampler
        after = await metrics_now(c, url)
    return {**run, **sample_summary(samples, before, after), "pressure_before": press, "pressure_after": pressure()}


def capacity(server_factory, args, vocab: int, client_run) -> dict:
    """The workload (see the module docstring): `server_factory(extra, slots)` starts a server (serve.py's
    `ServerProcess`, with `.argv`), `client_run` is serve.py's `http_run`."""
    import torch

    from reference import DEFAULT_DTYPES, reference_config

    clients = max(args.clients)
    dtype = getattr(torch, served_dtype(args.server_args) or args.dtype or DEFAULT_DTYPES[args.size])
    budget = kv_budget(
        reference_config(args.size), dtype, args.budget_rows, args.max_model_len, args.budget_divisor, args.block_size
    )
    jobs = capacity_jobs(
        args.requests,
        vocab,
        args.seed,
        (args.prompt_min, args.prompt_max, args.prompt_median, args.prompt_sigma),
        (args.new_min, args.new_max),
        args.max_model_len,
    )
    warm = jobs[: args.warmup_requests] if args.warmup_requests > 0 else jobs
    out = {
        "workload": "capacity",
        "clients": clients,
        "requests": args.requests,
        "seed": args.seed,
        "max_model_len": args.max_model_len,
        "rounds": args.rounds,
        "budget": budget,
        "lengths": length_summary(jobs),
        "commands": {"benchmark": shlex.join([sys.executable, *sys.argv])},
    }
    servers = {}
    try:
        for label, (slots, extra) in server_flags(budget, clients).items():
            servers[label] = server_factory(extra, slots)
            out["commands"][label] = shlex.join(servers[label].argv)
            start = time.perf_counter()
            asyncio.run(client_run(servers[label].url, warm, clients))  # compiles, excluded
            out[label] = {
                "warmup_s": round(time.perf_counter() - start, 2),
                "startup_log": startup_log(servers[label]),
                "rounds": [],
            }
            print(f"capacity: {label} server warmed up in {out[label]['warmup_s']} s", file=sys.stderr, flush=True)
        rounds = []
        for r in range(args.rounds):
            got = {}
            for label in ("static", "blocks") if r % 2 == 0 else ("blocks", "static"):
                got[label] = asyncio.run(
                    sampled_pass(servers[label].url, jobs, clients, args.sample_interval, client_run)
                )
                out[label]["rounds"].append(got[label])
                print(f"capacity: round {r} {label} {got[label]}", file=sys.stderr, flush=True)
            rounds.append(got)
    finally:
        for server in servers.values():
            server.stop()
    for label in ("static", "blocks"):
        out[label]["median"] = medians(out[label]["rounds"])
    out["ratios"] = ratios(rounds)
    return out


def startup_log(server, most: int = 30) -> list:
    """The server's lines up to the one saying where it serves (what it configured: its KV pool, its plan)."""
    lines = []
    for line in list(server.lines)[:most]:
        lines.append(line.rstrip())
        if "serving " in line:
            break
    return lines


def served_dtype(server_args: str):
    """The `--dtype` among the extra server flags (the KV cache's dtype then), or None."""
    words = server_args.split()
    for i, word in enumerate(words):
        if word == "--dtype" and i + 1 < len(words):
            return words[i + 1]
        if word.startswith("--dtype="):
            return word.split("=", 1)[1]
    return None


__all__ = [
    "capacity",
    "capacity_jobs",
    "kv_budget",
    "long_tail_lengths",
    "parse_metrics",
    "sample_summary",
    "ratios",
    "server_flags",
    "add_arguments",
]
