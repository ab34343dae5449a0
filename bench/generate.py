"""Generation benchmark: staticformers against transformers 5.23 on the same checkpoint, same run.

Builds (once) a ~41.6M-parameter Qwen3-shaped checkpoint (hidden 512, intermediate 1536, 8 layers,
8 heads, 4 KV heads, head_dim 64, vocab 32000, tied), then for each (dtype, batch) runs A B A B
interleaved: transformers default `generate`, transformers with its static cache forced to compile,
and staticformers. Prompt 128 tokens, 128 new greedy tokens (the checkpoint has no EOS, so every run
makes all 128). Prints one JSON object: decode tokens/s, time to first token, bandwidth utilisation
against the read bandwidth measured in the same run, peak memory, and (--mixed) compiles and compile
seconds for ten prompt lengths from 17 to 255, cold and with a warm on-disk cache.

    python bench/generate.py --dtypes float32 bfloat16 --batches 1 8 --repeats 3
    python bench/generate.py --mixed            # compile counts / seconds (runs subprocesses)
"""

from __future__ import annotations

import os
import sys

import argparse
import json
import statistics
import subprocess
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference import DEFAULT_DIR, build_reference, pressure  # noqa: E402

REF_DIR = os.environ.get("STATICFORMERS_BENCH_MODEL", DEFAULT_DIR)
PROMPT, NEW = 128, 128
MIXED_LENGTHS = [17, 40, 63, 90, 111, 130, 160, 190, 222, 255]




def read_bandwidth(repeats: int = 7) -> float:
    """GB/s of a streaming read (sum over 512 MB of float32), median of `repeats`."""
    x = torch.ones(128 * 1024 * 1024, dtype=torch.float32)
    x.sum()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return x.numel() * 4 / statistics.median(times) / 1e9


class PeakRSS:
    """Peak resident memory (bytes) while a block runs, sampled every millisecond."""

    def __enter__(self):
        import psutil

        self.proc = psutil.Process()
        self.peak = self.proc.memory_info().rss
        self.stop = False
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        return self

    def _watch(self):
        while not self.stop:
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.001)

    def __exit__(self, *exc):
        self.stop = True
        self.thread.join()


# ---------------------------------------------------------------------------------------------
# the contenders
# ---------------------------------------------------------------------------------------------
def make_runners(dtype: torch.dtype, batch: int, which: list[str]):
    import transformers

    from staticformers import AutoModelForCausalLM

    torch.manual_seed(1)
    ids = torch.randint(1, 32000, (batch, PROMPT))
    mask = torch.ones_like(ids)
    runners = {}
    if "hf" in which or "hf_static" in which:
        hf = transformers.AutoModelForCausalLM.from_pretrained(REF_DIR, dtype=dtype).eval()
    if "hf" in which:
        runners["hf"] = lambda n: hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False)
    if "hf_static" in which:
        cc = transformers.CompileConfig(fullgraph=True, dynamic=False)
        cc._compile_all_devices = True

        def hf_static(n):
            return hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                               cache_implementation="static", compile_config=cc)

        runners["hf_static"] = hf_static
    if "sf" in which:
        sf = AutoModelForCausalLM.from_pretrained(REF_DIR, dtype=dtype)
        runners["sf"] = lambda n: sf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False)
        runners["_sf_model"] = sf
    return runners


def timed(fn, n):
    t = time.perf_counter()
    out = fn(n)
    return time.perf_counter() - t, out


def bench_case(dtype_name: str, batch: int, repeats: int, which: list[str], bandwidth: float) -> dict:
    dtype = getattr(torch, dtype_name)
    runners = make_runners(dtype, batch, which)
    sf_model = runners.pop("_sf_model", None)
    warm = {}
    for name, fn in runners.items():  # warm-up: compiles, caches
        t = time.perf_counter()
        fn(NEW)
        fn(1)
        warm[name] = round(time.perf_counter() - t, 2)
    results = {name: {"total": [], "ttft": []} for name in runners}
    for _ in range(repeats):  # interleaved A B A B
        for name, fn in runners.items():
            ttft, _ = timed(fn, 1)
            total, out = timed(fn, NEW)
            assert out.shape == (batch, PROMPT + NEW), out.shape
            results[name]["ttft"].append(ttft)
            results[name]["total"].append(total)
    params = 0
    weight_bytes = 0
    if sf_model is not None:
        seen = {}
        for p in sf_model.parameters():
            seen[id(p)] = p
        params = sum(p.numel() for p in seen.values())
        embed = sf_model.model.embed_tokens.weight
        tied = sf_model.lm_head.weight is embed
        weight_bytes = sum(p.numel() * p.element_size() for p in seen.values())
        if not tied:  # an untied embedding is read one row per token, not whole
            weight_bytes -= embed.numel() * embed.element_size()
    out = {"dtype": dtype_name, "batch": batch, "warmup_seconds": warm, "pressure_after": pressure()}
    for name, r in results.items():
        ttft, total = statistics.median(r["ttft"]), statistics.median(r["total"])
        decode_s = max(total - ttft, 1e-9)
        per_step = decode_s / (NEW - 1)
        entry = {"ttft_ms": round(ttft * 1000, 2), "total_s": round(total, 4),
                 "decode_tok_s": round(batch * (NEW - 1) / decode_s, 1),
                 "decode_tok_s_per_seq": round((NEW - 1) / decode_s, 1)}
        if weight_bytes:
            kv_bytes_avg = 8 * 2 * 4 * 64 * (PROMPT + NEW // 2) * batch * torch.tensor([], dtype=dtype).element_size()
            gbs = (weight_bytes + kv_bytes_avg) / per_step / 1e9
            entry["weights_gb_s"] = round(gbs, 1)
            entry["bandwidth_utilisation"] = round(gbs / bandwidth, 3)
        out[name] = entry
    if "hf" in out and "sf" in out:
        out["ratio_decode_vs_hf"] = round(out["sf"]["decode_tok_s"] / out["hf"]["decode_tok_s"], 2)
        out["ratio_ttft_vs_hf"] = round(out["hf"]["ttft_ms"] / out["sf"]["ttft_ms"], 2)
    if "hf_static" in out and "sf" in out:
        out["ratio_decode_vs_hf_static"] = round(out["sf"]["decode_tok_s"] / out["hf_static"]["decode_tok_s"], 2)
    out["params"] = params
    return out


# ---------------------------------------------------------------------------------------------
# memory (one contender per subprocess, so peaks do not mix)
# ---------------------------------------------------------------------------------------------
def memory_case(dtype_name: str, batch: int, baseline: str = "compiler") -> dict:
    """Peak RSS of a second `generate` over the RSS before loading, against weights + KV cache.

    `baseline="compiler"`: the compiler itself is loaded first (one trivial compile: inductor's modules,
    its worker pool). `"library"`: a tiny model (hidden 64, 2 layers) is loaded, compiled and generated
    with first, at the same batch, then deleted: what the first compile of a process brings in whatever
    the model (code paths, runtime pools, freed heap a later compile reuses) is then in the baseline,
    so the figure is what this model adds."""
    import gc

    import psutil

    from staticformers import AutoConfig, AutoModelForCausalLM
    from staticformers.generation.api import engine_for

    dtype = getattr(torch, dtype_name)
    torch.compile(lambda x: x * 2, backend="inductor", fullgraph=True)(torch.ones(8))
    if baseline == "library":
        cfg = AutoConfig.for_model("qwen3", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)
        tiny = AutoModelForCausalLM.from_config(cfg, seed=0).to(dtype)
        tiny.generate(input_ids=torch.randint(1, 256, (batch, PROMPT)), max_new_tokens=4, do_sample=False)
        del tiny
        gc.collect()
    base = psutil.Process().memory_info().rss
    sf = AutoModelForCausalLM.from_pretrained(REF_DIR, dtype=dtype)
    ids = torch.randint(1, 32000, (batch, PROMPT))
    sf.generate(input_ids=ids, max_new_tokens=NEW, do_sample=False)  # compile (or warm cache)
    with PeakRSS() as peak:
        sf.generate(input_ids=ids, max_new_tokens=NEW, do_sample=False)
    weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in sf.parameters()}.values())
    kv = sum(c.nbytes for c in engine_for(sf).caches.values())
    used = peak.peak - base
    return {"dtype": dtype_name, "batch": batch, "baseline": baseline,
            "weights_mb": round(weights / 2**20, 1), "kv_mb": round(kv / 2**20, 1),
            "peak_over_baseline_mb": round(used / 2**20, 1), "ratio": round(used / (weights + kv), 2)}


# ---------------------------------------------------------------------------------------------
# mixed prompt lengths: compiles and compile seconds (each in a fresh process)
# ---------------------------------------------------------------------------------------------
def mixed_case(who: str, dtype_name: str) -> dict:
    from torch._dynamo.utils import counters

    dtype = getattr(torch, dtype_name)
    torch.manual_seed(2)
    t0 = time.perf_counter()
    if who == "sf":
        from staticformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(REF_DIR, dtype=dtype)
        run = lambda ids: model.generate(input_ids=ids, max_new_tokens=16, do_sample=False)
    else:
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(REF_DIR, dtype=dtype).eval()
        cc = transformers.CompileConfig(dynamic=False)  # its default fullgraph=False: past the limit it runs eager
        cc._compile_all_devices = True
        run = lambda ids: model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                                         do_sample=False, cache_implementation="static", compile_config=cc)
    load = time.perf_counter() - t0
    t0 = time.perf_counter()
    for n in MIXED_LENGTHS:
        run(torch.randint(1, 32000, (1, n)))
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for n in MIXED_LENGTHS:
        run(torch.randint(1, 32000, (1, n)))
    second = time.perf_counter() - t0
    out = {"who": who, "dtype": dtype_name, "graphs": int(counters["stats"]["unique_graphs"]),
           "frames_ok": int(counters["frames"]["ok"]), "first_pass_s": round(first, 2), "second_pass_s": round(second, 2),
           "compile_s_estimate": round(first - second, 2), "load_s": round(load, 2)}
    if who == "sf":
        stats = model.compile_stats()
        out["sf_graphs"] = [(s["kind"], s["shape"], s["first_call_seconds"]) for s in stats]
        out["sf_graph_count"] = sum(s["graphs"] for s in stats)  # traced and compiled, or loaded whole
        out["artifacts_loaded"] = int(counters["staticformers"]["artifacts_loaded"])
    return out


def _subprocess(args: list[str], env: dict) -> dict:
    res = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=env)
    if res.returncode != 0:
        return {"error": res.stderr[-2000:]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--which", nargs="+", default=["hf", "hf_static", "sf"])
    ap.add_argument("--mixed", action="store_true", help="measure compile counts/seconds for mixed prompt lengths")
    ap.add_argument("--memory", action="store_true", help="measure peak memory of staticformers")
    ap.add_argument("--_mixed_case", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--_memory_case", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    build_reference(REF_DIR)
    if args._mixed_case:
        print(json.dumps(mixed_case(*args._mixed_case)))
        return
    if args._memory_case:
        print(json.dumps(memory_case(args._memory_case[0], int(args._memory_case[1]), args._memory_case[2])))
        return
    report = {"torch": torch.__version__, "pressure_before": pressure(), "cases": []}
    if args.mixed:
        def fresh_cache_env() -> dict:  # an empty compile cache (inductor's kernels, ISA probes, headers)
            cache = tempfile.mkdtemp(prefix="sf-bench-cache-")
            return dict(os.environ, STATICFORMERS_CACHE=cache, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"))

        for dtype in args.dtypes:
            if "hf_static" in args.which or "hf" in args.which:
                report["cases"].append(_subprocess(["--_mixed_case", "hf", dtype], fresh_cache_env()))
            if "sf" in args.which:
                env = fresh_cache_env()
                report["cases"].append(_subprocess(["--_mixed_case", "sf", dtype], env))  # cold
                report["cases"].append(_subprocess(["--_mixed_case", "sf", dtype], env))  # warm on-disk cache
    elif args.memory:
        for dtype in args.dtypes:
            for batch in args.batches:
                for baseline in ("compiler", "library"):
                    report["cases"].append(_subprocess(["--_memory_case", dtype, str(batch), baseline], dict(os.environ)))
    else:
        report["bandwidth_gb_s"] = round(read_bandwidth(), 1)
        for dtype in args.dtypes:
            for batch in args.batches:
                report["cases"].append(bench_case(dtype, batch, args.repeats, args.which, report["bandwidth_gb_s"]))
        report["bandwidth_gb_s_after"] = round(read_bandwidth(), 1)
    report["pressure_after"] = pressure()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
