"""The serving workloads of prefix caching and chunked prefill (`bench/serve.py --workload ...`): each runs our
server twice on the same requests, with and without the feature, and reports the ratios.

- **shared-prefix**: `--clients` clients (16), each request a shared `--system`-token system prompt (1,000)
  and a short user turn of its own; one request in ten starts with a system prompt of its own instead (a
  miss), so about 90% of prompt tokens can hit. A warm-up pass of requests of the same shapes first
  (compiles; the pool then holds the shared prompt: the steady state of a server that has seen it; the
  measured passes' user turns and own system prompts are new; `--rounds` passes, each with new ones). Reported,
  the median over the rounds (each round's figures beside it):
  TTFT, output tokens/s, and the hit rate the server counted during the measured pass
  (`prefix_cache_hits / prefix_cache_queries` on `/metrics`), without prefix caching (`no_cache`), with the static
  caches' prefix pool, whose hits are copied into a request's row (`prefix_cache`), and with block caches, whose hits
  are shared blocks (`shared_blocks`: `--num-gpu-blocks-override` the blocks of the static caches' memory, one
  `--max-model-len` row per client).
- **long-prompt**: `--clients - 1` clients decoding (short prompts, `--new` tokens each) when one
  `--long`-token prompt (2,000) arrives: the decoding clients' inter-token latency p50/p99 with and
  without `--enable-chunked-prefill`, and the long request's TTFT.
"""

from __future__ import annotations

import asyncio
import re
import statistics
import time


def counter(url: str, name: str) -> float:
    """`staticformers:<name>` from the server's `/metrics`, summed over its labels (0 when absent)."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(v) for v in re.findall(rf"^staticformers:{name}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M))


async def tagged_run(url: str, jobs: list) -> dict:
    """Every job `(prompt, new, tag, delay_s)` sent by its own client after `delay_s`, streamed; per tag the
    TTFTs and inter-token latencies, and the output tokens and wall time of the whole run."""
    import httpx

    out: dict = {}
    tokens = [0]

    async def one(c, prompt, new, tag, delay):
        await asyncio.sleep(delay)
        body = {
            "model": "ref",
            "prompt": prompt,
            "max_tokens": new,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
        rec = out.setdefault(tag, {"ttft": [], "itl": []})
        start = last = time.perf_counter()
        first = True
        async with c.stream("POST", url + "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.perf_counter()
                rec["ttft" if first else "itl"].append(now - (start if first else last))
                first, last = False, now
                tokens[0] += 1

    async with httpx.AsyncClient(timeout=1200, limits=httpx.Limits(max_connections=len(jobs) + 4)) as c:
        start = time.perf_counter()
        await asyncio.gather(*[one(c, *job) for job in jobs])
        wall = time.perf_counter() - start
    return {"by_tag": out, "tokens": tokens[0], "wall": wall}


def _ms(x):
    return None if x is None else round(x * 1000, 2)


def _pct(values, q):
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def shared_prefix_jobs(requests: int, system: int, vocab: int, seed: int = 0) -> list:
    """`requests` prompts: one in ten a system prompt of its own, the others the shared one (the same for every
    seed); each then a user turn of 8-24 tokens (so a prompt stays within 1,024 tokens: the default prompt
    bucket). Another `seed` gives other user turns and other own system prompts (misses)."""
    import torch

    shared = torch.randint(1, vocab, (system,), generator=torch.Generator().manual_seed(0)).tolist()
    g = torch.Generator().manual_seed(1000 + seed)
    jobs = []
    for i in range(requests):
        head = torch.randint(1, vocab, (system,), generator=g).tolist() if i % 10 == 9 else shared
        turn = torch.randint(1, vocab, (int(torch.randint(8, 25, (1,), generator=g)),), generator=g).tolist()
        jobs.append(head + turn)
    return jobs


def _median_row(rounds: list) -> dict:
    """The rounds' median of every figure, the rounds themselves under "rounds" (a graph compiled in a round, a shape
    the passes before had not met, stalls every running request while it compiles: compare the rounds with none)."""
    row = {k: round(statistics.median(r[k] for r in rounds), 3) for k in rounds[0] if rounds[0][k] is not None}
    row["graphs_after_warmup"] = sum(r["graphs_compiled"] for r in rounds)
    row["rounds"] = rounds
    return row


async def _clients_run(url: str, prompts: list, clients: int, new: int, misses: frozenset = frozenset()) -> dict:
    """`clients` clients taking the prompts in order, one request at a time each; `misses`: the indices of the
    prompts whose system prompt is their own, whose TTFT is also reported apart."""
    queue: asyncio.Queue = asyncio.Queue()
    for i, p in enumerate(prompts):
        queue.put_nowait((i, p))
    results = []

    async def client():
        while not queue.empty():
            i, p = queue.get_nowait()
            results.append((i, await tagged_run(url, [(p, new, "r", 0.0)])))

    start = time.perf_counter()
    await asyncio.gather(*[client() for _ in range(clients)])
    wall = time.perf_counter() - start
    ttft = [t for _, r in results for t in r["by_tag"]["r"]["ttft"]]
    missed = [t for i, r in results if i in misses for t in r["by_tag"]["r"]["ttft"]]
    itl = [t for _, r in results for t in r["by_tag"]["r"]["itl"]]
    tokens = sum(r["tokens"] for _, r in results)
    return {
        "ttft_ms_p50": _ms(statistics.median(ttft)),
        "ttft_ms_p99": _ms(_pct(ttft, 0.99)),
        "ttft_ms_misses_p50": _ms(statistics.median(missed)) if missed else None,
        "itl_ms_p50": _ms(_pct(itl, 0.5)),
        "itl_ms_p99": _ms(_pct(itl, 0.99)),
        "output_tokens_per_s": round(tokens / wall, 2),
        "output_tokens": tokens,
        "wall_s": round(wall, 2),
    }


def shared_prefix(server_factory, args, vocab: int) -> dict:
    warm = shared_prefix_jobs(args.requests, args.system, vocab, 0)
    measured = [shared_prefix_jobs(args.requests, args.system, vocab, 1 + r) for r in range(args.rounds)]
    out = {
        "workload": "shared-prefix",
        "clients": args.clients[-1],
        "requests": args.requests,
        "system": args.system,
        "new": args.new,
    }
    blocks = args.clients[-1] * args.max_model_len // 32  # the static rows' positions, in the server's 32-token blocks
    misses = frozenset(i for i in range(args.requests) if i % 10 == 9)  # `shared_prefix_jobs`' own system prompts
    arms = {
        "no_cache": [],
        "prefix_cache": ["--enable-prefix-caching"],
        "shared_blocks": ["--enable-prefix-caching", "--num-gpu-blocks-override", str(blocks)],
    }
    for label, extra in ((a, arms[a]) for a in getattr(args, "arms", None) or arms):
        server = server_factory(extra)
        try:
            asyncio.run(_clients_run(server.url, warm, args.clients[-1], args.new))  # warm-up: other turns
            rounds = []
            for prompts in measured:  # each round new user turns and own system prompts
                q0, h0, g0 = (
                    counter(server.url, n)
                    for n in ("prefix_cache_queries_total", "prefix_cache_hits_total", "graphs_compiled_total")
                )
                row = asyncio.run(_clients_run(server.url, prompts, args.clients[-1], args.new, misses))
                q, h = (
                    counter(server.url, "prefix_cache_queries_total") - q0,
                    counter(server.url, "prefix_cache_hits_total") - h0,
                )
                row["prefix_hit_rate"] = round(h / q, 3) if q else None
                row["graphs_compiled"] = counter(server.url, "graphs_compiled_total") - g0
                rounds.append(row)
        finally:
            server.stop()
        out[label] = _median_row(rounds)
    ratios = {}
    if "no_cache" in out and "prefix_cache" in out:
        ratios["ttft_p50_no_cache_over_cache"] = round(
            out["no_cache"]["ttft_ms_p50"] / out["prefix_cache"]["ttft_ms_p50"], 2
        )
        ratios["output_tokens_per_s_cache_over_no_cache"] = round(
            out["prefix_cache"]["output_tokens_per_s"] / out["no_cache"]["output_tokens_per_s"], 2
        )
    if "shared_blocks" in out and "prefix_cache" in out:
        for figure in ("ttft_ms_p50", "ttft_ms_p99"):
            ratios[f"{figure}_shared_over_copied"] = round(
                out["shared_blocks"][figure] / out["prefix_cache"][figure], 2
            )
        ratios["output_tokens_per_s_shared_over_copied"] = round(
            out["shared_blocks"]["output_tokens_per_s"] / out["prefix_cache"]["output_tokens_per_s"], 2
        )
    out["ratios"] = ratios
    return out


def long_prompt(server_factory, args, vocab: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(1)
    decoders = [
        (torch.randint(1, vocab, (64,), generator=g).tolist(), args.new, "decode", 0.0)
        for _ in range(args.clients[-1] - 1)
    ]
    long = [(torch.randint(1, vocab, (args.long,), generator=g).tolist(), 16, "long", args.long_delay)]
    warm = [(d[0], 4, "decode", 0.0) for d in decoders] + [(long[0][0], 2, "long", 0.0)]
    out = {"workload": "long-prompt", "decoding_clients": len(decoders), "long": args.long, "new": args.new}
    for label, extra in (("unchunked", []), ("chunked", ["--enable-chunked-prefill"])):
        server = server_factory(extra)
        try:
            asyncio.run(tagged_run(server.url, warm))  # compiles what the run meets
            asyncio.run(tagged_run(server.url, decoders[:1] + long))
            g0 = counter(server.url, "graphs_compiled_total")
            run = asyncio.run(tagged_run(server.url, decoders + long))
            graphs = counter(server.url, "graphs_compiled_total") - g0
        finally:
            server.stop()
        itl = run["by_tag"]["decode"]["itl"]
        out[label] = {
            "decode_itl_ms_p50": _ms(_pct(itl, 0.5)),
            "decode_itl_ms_p99": _ms(_pct(itl, 0.99)),
            "decode_itl_ms_max": _ms(max(itl)),
            "long_ttft_ms": _ms(run["by_tag"]["long"]["ttft"][0]),
            "output_tokens_per_s": round(run["tokens"] / run["wall"], 2),
            "graphs_after_warmup": graphs,
        }
    out["ratios"] = {
        "decode_itl_p99_unchunked_over_chunked": round(
            out["unchunked"]["decode_itl_ms_p99"] / out["chunked"]["decode_itl_ms_p99"], 2
        )
    }
    return out


__all__ = ["shared_prefix", "long_prompt", "shared_prefix_jobs", "tagged_run", "counter"]
