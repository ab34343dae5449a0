"""Generation benchmark: staticformers against transformers on the same checkpoint, same device, same run.

Uses a reference checkpoint (bench/reference.py: `--size 41m`, the default, 41.6M parameters; `1.7b`,
Qwen3-1.7B-shaped; `tiny`), then for each (dtype, batch) runs A B A B interleaved on `--device`:
transformers' default `generate` (`hf`), transformers with `cache_implementation="static"` and its
compile (`hf_static`: on a GPU the compile transformers applies by itself, inductor with CUDA graphs;
on the CPU forced with `fullgraph=True, dynamic=False`), and staticformers (`sf`, its default compile,
`--compile-mode` passed through, e.g. `reduce-overhead` for CUDA graphs). Prompt `--prompt` tokens
(128), `--new` new greedy tokens (128; no EOS, so every run makes them all). On a GPU every time is
wall time with the device synchronized at both ends. Prints one JSON object (and writes it to `--out`
after every case, so a run stopped by a time limit keeps what it measured): decode tokens/s, time to
first token, bandwidth utilisation against the ceiling measured in the same run on the same device
(bench/ceilings.py: a copy of the weights' size on a GPU; on the CPU the best of `torch.mv`, `sum` and a
compiled multiply-and-sum over the weights' bytes), sampled between the contenders' timed rounds and
taken as the best of all samples, so the ceiling and the contenders see the same machine states (a
contender reading faster than every probe is listed under `ceiling_misses`, never hidden),
graphs compiled after the warm-up (should be 0), peak memory, and (--mixed, CPU) compiles and compile
seconds for ten prompt lengths from 17 to 255, cold and with a warm on-disk cache.

    python bench/generate.py --dtypes float32 bfloat16 --batches 1 8 --repeats 3
    python bench/generate.py --device cuda --size 1.7b --dtypes bfloat16 --batches 1 8
    python bench/generate.py --mixed            # compile counts / seconds (runs subprocesses)
    python bench/generate.py --device xla       # XLA's CPU device, in the XLA environment (generate_xla.py)
    python bench/generate.py --dtypes bfloat16 --which sf --quantization int8   # int8 beside bf16, same run
    python bench/generate.py --which sf openvino openvino_int8 --quantization int8   # OpenVINO's too (CPU)

`torchao_int8` is transformers' model with torchao's `Int8WeightOnlyConfig` (`quantize_`, the head exact),
run as `hf_static` is (the `bench` extra's torchao):

    python bench/generate.py --which sf hf_static torchao_int8 --quantization int8

`openvino` and `openvino_int8` (bench/openvino_peer.py) are OpenVINO through optimum-intel, exported once
from the reference, its precision pinned to the case's dtype (`INFERENCE_PRECISION_HINT`); they need the
`openvino` extra, which pins a transformers of its own, so they run in a venv of their own.
"""

from __future__ import annotations

import os
import sys

import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ceilings import (
    Clock,
    MemoryCeiling,
    check_device,
    device_info,
    matmul_ceiling,  # noqa: E402
    peak_memory_gb,
    reset_peak_memory,
    sig,
)
from reference import SIZES, build_reference, pressure, reference_dir  # noqa: E402

import openvino_peer  # noqa: E402  (imports optimum-intel only when one of its contenders runs)

REF_DIR = os.environ.get("STATICFORMERS_BENCH_MODEL") or reference_dir("41m")
PROMPT, NEW = 128, 128
MIXED_LENGTHS = [17, 40, 63, 90, 111, 130, 160, 190, 222, 255]


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
def hf_static_compile_config(device: torch.device, backend: str):
    """transformers' compile for its static cache: on a GPU (inductor) the one it applies by itself (None:
    its default CompileConfig, inductor with mode "reduce-overhead", i.e. CUDA graphs); on the CPU, or with
    another backend, forced with `fullgraph=True, dynamic=False`."""
    import transformers

    if device.type == "cuda" and backend == "inductor":
        return None
    cc = transformers.CompileConfig(fullgraph=True, dynamic=False, backend=backend)
    cc._compile_all_devices = True  # transformers compiles on cuda/xpu/neuron/tpu only unless told
    return cc


QUANTIZED = {  # contender -> our QuantizationConfig's fields (--quantization int8)
    "sf_int8": dict(quant_type="int8_weight_only"),  # the default: the lm_head stays exact
    "sf_int8_head": dict(quant_type="int8_weight_only", include_input_output_embeddings=True),
}


def make_runners(
    dtype: torch.dtype,
    batch: int,
    which: list[str],
    device: torch.device,
    ref_dir: str,
    prompt: int,
    compile_mode: str | None,
    backend: str,
):
    """name -> fn(max_new_tokens) for each contender on `device`; "_sf_model" -> our model ("_<name>_model"
    for the quantized contenders of `QUANTIZED`)."""
    import transformers

    from staticformers import AutoModelForCausalLM, CompileConfig

    vocab = int(_config(ref_dir)["vocab_size"])
    torch.manual_seed(1)
    ids = torch.randint(1, vocab, (batch, prompt))
    mask = torch.ones_like(ids)
    ids_dev, mask_dev = ids.to(device), mask.to(device)  # transformers' inputs live on its device
    runners = {}
    if "hf" in which or "hf_static" in which:
        hf = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=dtype).to(device).eval()
    if "hf" in which:
        runners["hf"] = lambda n: hf.generate(
            input_ids=ids_dev, attention_mask=mask_dev, max_new_tokens=n, do_sample=False
        )
    if "hf_static" in which:
        cc = hf_static_compile_config(device, backend)

        def hf_static(n):
            return hf.generate(
                input_ids=ids_dev,
                attention_mask=mask_dev,
                max_new_tokens=n,
                do_sample=False,
                cache_implementation="static",
                compile_config=cc,
            )

        runners["hf_static"] = hf_static
    if "sf" in which:
        sf = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=dtype, device_map=str(device))
        config = CompileConfig(backend=None if backend == "inductor" else backend, mode=compile_mode)
        # our inputs stay on the host (the engine's way: only fixed-shape slices go to the device)
        runners["sf"] = lambda n: sf.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False, compile_config=config
        )
        runners["_sf_model"] = sf
    for name, fields in QUANTIZED.items():
        if name not in which:
            continue
        from staticformers import QuantizationConfig

        qm = AutoModelForCausalLM.from_pretrained(
            ref_dir, dtype=dtype, device_map=str(device), quantization_config=QuantizationConfig(**fields)
        )
        config = CompileConfig(backend=None if backend == "inductor" else backend, mode=compile_mode)
        runners[name] = _generator(qm, ids, mask, config)
        runners[f"_{name}_model"] = qm
    if "torchao_int8" in which:  # torchao's own weight-only int8 on transformers' model, compiled as hf_static
        runners["torchao_int8"], runners["_torchao_info"] = torchao_runner(
            dtype, device, ref_dir, ids_dev, mask_dev, backend
        )
    if any(n in which for n in openvino_peer.CONTENDERS):
        ov, runners["_openvino_info"] = openvino_peer.make_runners(
            str(dtype).removeprefix("torch."), which, ref_dir, ids, mask
        )
        runners.update(ov)
    return runners


def _generator(model, ids, mask, config):
    """`runner(n)`: the model's greedy `generate` of n new tokens on the benchmark's inputs."""
    return lambda n: model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False, compile_config=config
    )


def torchao_runner(dtype: torch.dtype, device: torch.device, ref_dir: str, ids, mask, backend: str):
    """transformers' model of the reference with torchao's `Int8WeightOnlyConfig` (per output channel, as
    ours) applied by `quantize_` to every projection, the `lm_head` left exact (as `sf_int8` and transformers'
    `TorchAoConfig` default), generated with the static cache and the same compile as `hf_static`."""
    import torchao
    import transformers
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    model = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=dtype).to(device).eval()
    quantize_(
        model, Int8WeightOnlyConfig(), filter_fn=lambda m, name: isinstance(m, torch.nn.Linear) and name != "lm_head"
    )
    cc = hf_static_compile_config(device, backend)

    def run(n):
        return model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=n,
            do_sample=False,
            cache_implementation="static",
            compile_config=cc,
        )

    return run, {
        "torchao_int8": {
            "torchao": torchao.__version__,
            "weight_type": type(model.model.layers[0].mlp.up_proj.weight).__name__,
        }
    }


def _config(ref_dir: str) -> dict:
    with open(os.path.join(ref_dir, "config.json")) as f:
        return json.load(f)


def dynamo_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def weights_read_per_step(model) -> int:
    """Bytes of weights a decode step reads: every parameter once (a tied embedding is the lm_head's
    weight, read whole; an untied one is read a row per token, so not counted)."""
    seen = {id(p): p for p in model.parameters()}
    total = sum(p.numel() * p.element_size() for p in seen.values())
    embed = model.model.embed_tokens.weight
    if model.lm_head.weight is not embed:
        total -= embed.numel() * embed.element_size()
    return total


def bench_case(
    dtype_name: str,
    batch: int,
    repeats: int,
    which: list[str],
    device: torch.device,
    ref_dir: str,
    prompt: int,
    new: int,
    compile_mode: str | None,
    backend: str,
    ceiling: dict,
    memory: MemoryCeiling | None = None,
) -> dict:
    """One (dtype, batch) case; `memory` is sampled after every timed round of the contenders, and the case's
    utilisations are against `memory`'s best so far (`add_utilisation` recomputes them at the end of a run)."""
    dtype = getattr(torch, dtype_name)
    reset_peak_memory(device)
    runners = make_runners(dtype, batch, which, device, ref_dir, prompt, compile_mode, backend)
    sf_model = runners.pop("_sf_model", None)
    quantized = {name: runners.pop(f"_{name}_model") for name in QUANTIZED if f"_{name}_model" in runners}
    openvino_info = {**runners.pop("_openvino_info", {}), **runners.pop("_torchao_info", {})}
    warm, graphs_in_warmup = {}, {}
    for name, fn in runners.items():  # warm-up: compiles, caches
        before = dynamo_graphs()
        with Clock(device) as c:
            fn(new)
            fn(1)
        warm[name] = round(c.seconds, 2)
        graphs_in_warmup[name] = dynamo_graphs() - before
    results = {name: {"total": [], "ttft": [], "graphs": 0} for name in runners}
    peak = None  # a GPU's peak memory, read before each ceiling sample (whose buffers would count)
    for _ in range(repeats):  # interleaved A B A B
        for name, fn in runners.items():
            before = dynamo_graphs()
            with Clock(device) as c:
                fn(1)
            results[name]["ttft"].append(c.seconds)
            with Clock(device) as c:
                out = fn(new)
            results[name]["total"].append(c.seconds)
            results[name]["graphs"] += dynamo_graphs() - before
            assert out.shape == (batch, prompt + new), out.shape
        if memory is not None:  # the ceiling read in the same machine state as the round it follows
            peak = max(peak or 0.0, peak_memory_gb(device) or 0.0) if device.type == "cuda" else None
            memory.sample(repeats=3)
            reset_peak_memory(device)
    cfg = _config(ref_dir)
    size = torch.tensor([], dtype=dtype).element_size()
    kv_bytes_avg = (
        cfg["num_hidden_layers"]
        * 2
        * cfg["num_key_value_heads"]
        * cfg.get("head_dim", 0)
        * (prompt + new // 2)
        * batch
        * size
    )
    weight_bytes = weights_read_per_step(sf_model) if sf_model is not None else 0
    # a forward pass over the prompt: 2 FLOP per weight and token, plus causal attention's scores and values
    prefill_flops = (
        batch
        * prompt
        * (
            2 * weight_bytes // size
            + 2 * cfg["num_hidden_layers"] * cfg["num_attention_heads"] * cfg.get("head_dim", 0) * prompt
        )
    )
    out = {
        "dtype": dtype_name,
        "batch": batch,
        "prompt": prompt,
        "new": new,
        "warmup_seconds": warm,
        "graphs_in_warmup": graphs_in_warmup,
        "peak_memory_gb": max(peak, peak_memory_gb(device) or 0.0) if peak is not None else peak_memory_gb(device),
        "pressure_after": pressure(),
    }
    for name, r in results.items():
        ttft, total = statistics.median(r["ttft"]), statistics.median(r["total"])
        decode_s = max(total - ttft, 1e-9)
        per_step = decode_s / max(new - 1, 1)
        entry = {
            "ttft_ms": round(ttft * 1000, 2),
            "total_s": round(total, 4),
            "decode_tok_s": round(batch * (new - 1) / decode_s, 1),
            "decode_tok_s_per_seq": round((new - 1) / decode_s, 1),
            "step_ms": round(per_step * 1000, 3),
            "graphs_after_warmup": r["graphs"],
        }  # Dynamo graphs compiled while timed: 0 expected
        if name in openvino_info:
            entry.update(openvino_info[name])
        if name == "openvino_int8":  # its bytes are its own (int8, embedding and head included): the file's size
            if weight_bytes:
                entry["weight_file_bytes_vs_sf"] = round(entry["weight_file_bytes"] / weight_bytes, 3)
        elif name in quantized:  # its own bytes, against the int8 probe (`add_utilisation`)
            q_bytes = weights_read_per_step(quantized[name])
            entry["weight_bytes_per_step"] = q_bytes
            entry["int8_gb_s"] = sig((q_bytes + kv_bytes_avg) / per_step / 1e9)
            if weight_bytes:
                entry["weight_bytes_vs_sf"] = round(q_bytes / weight_bytes, 3)
        elif weight_bytes:
            entry["weights_gb_s"] = sig((weight_bytes + kv_bytes_avg) / per_step / 1e9)
            entry["prefill_tflop_s"] = sig(prefill_flops / ttft / 1e12)  # the first token's time is the prompt's pass
        out[name] = entry
    if memory is not None:
        ceiling["memory"] = memory.result()
    add_utilisation(out, ceiling)
    if "hf" in out and "sf" in out:
        out["ratio_decode_vs_hf"] = round(out["sf"]["decode_tok_s"] / out["hf"]["decode_tok_s"], 2)
        out["ratio_ttft_vs_hf"] = round(out["hf"]["ttft_ms"] / out["sf"]["ttft_ms"], 2)
    if "hf_static" in out and "sf" in out:
        out["ratio_decode_vs_hf_static"] = round(out["sf"]["decode_tok_s"] / out["hf_static"]["decode_tok_s"], 2)
        out["ratio_ttft_vs_hf_static"] = round(out["hf_static"]["ttft_ms"] / out["sf"]["ttft_ms"], 2)
    for ours, peer in (
        ("sf", "openvino"),
        ("sf_int8", "openvino_int8"),
        ("sf_int8_head", "openvino_int8"),
        ("sf_int8", "torchao_int8"),
        ("torchao_int8", "hf_static"),
    ):
        if ours in out and peer in out:
            out[f"ratio_decode_{ours}_vs_{peer}"] = round(out[ours]["decode_tok_s"] / out[peer]["decode_tok_s"], 2)
            out[f"ratio_ttft_{ours}_vs_{peer}"] = round(out[peer]["ttft_ms"] / out[ours]["ttft_ms"], 2)
    for name in quantized:
        if "sf" in out:
            out[f"ratio_decode_{name}_vs_sf"] = round(out[name]["decode_tok_s"] / out["sf"]["decode_tok_s"], 2)
            out[f"ratio_ttft_{name}_vs_sf"] = round(out["sf"]["ttft_ms"] / out[name]["ttft_ms"], 2)
        out[f"{name}_graphs"] = sum(s["graphs"] for s in quantized[name].compile_stats())
    if sf_model is not None:
        stats = sf_model.compile_stats()
        out["sf_graphs"] = sum(s["graphs"] for s in stats)
        out["sf_compile_seconds"] = round(sum(s["compile_seconds"] for s in stats), 2)
        out["params"] = sf_model.num_parameters()
        out["weight_bytes_per_step"] = weight_bytes
    return out


def add_utilisation(case: dict, ceiling: dict) -> None:
    """Each contender's bandwidth and prefill FLOP utilisation against `ceiling` (its dtype's `memory` and
    `matmul`), and `ceiling_misses`: the contenders that read faster than the memory ceiling (its probes
    missed a faster way to read those bytes; the utilisation then reads above 1 and says so)."""
    misses = []
    for name, entry in case.items():
        if not isinstance(entry, dict) or "weights_gb_s" not in entry:
            continue
        entry["bandwidth_utilisation"] = sig(entry["weights_gb_s"] / ceiling["memory"]["gb_s"])
        entry["prefill_flops_utilisation"] = sig(entry["prefill_tflop_s"] / ceiling["matmul"]["tflop_s"])
        if entry["bandwidth_utilisation"] > 1:
            misses.append(name)
    int8 = ceiling.get("int8_memory")
    for name, entry in case.items():
        if isinstance(entry, dict) and "int8_gb_s" in entry and int8 is not None:
            entry["int8_bandwidth_utilisation"] = sig(entry["int8_gb_s"] / int8["gb_s"])
            if entry["int8_bandwidth_utilisation"] > 1:
                misses.append(name)
    case["ceiling_gb_s"] = ceiling["memory"]["gb_s"]
    if int8 is not None:
        case["int8_ceiling_gb_s"] = int8["gb_s"]
    case["ceiling_misses"] = misses


# ---------------------------------------------------------------------------------------------
# memory (one contender per subprocess, so peaks do not mix)
# ---------------------------------------------------------------------------------------------
SAVED_ENV = "STATICFORMERS_BENCH_INT8_SAVED"  # the folder of `save_int8`, for the memory subprocesses


def save_int8(dtype_name: str) -> str:
    """The reference quantized as `sf_int8` and saved (a compressed-tensors folder), in a temporary folder."""
    from staticformers import AutoModelForCausalLM, QuantizationConfig

    folder = tempfile.mkdtemp(prefix="sf-bench-int8-")
    model = AutoModelForCausalLM.from_pretrained(
        REF_DIR, dtype=getattr(torch, dtype_name), quantization_config=QuantizationConfig(**QUANTIZED["sf_int8"])
    )
    model.save_pretrained(folder)
    return folder


def memory_case(dtype_name: str, batch: int, baseline: str = "compiler", quantized: str = "") -> dict:
    """Peak RSS of a second `generate` over the RSS before loading, against weights + KV cache.

    `baseline="compiler"`: the compiler itself is loaded first (one trivial compile: inductor's modules,
    its worker pool). `"library"`: a tiny model (hidden 64, 2 layers) is loaded, compiled and generated
    with first, at the same batch, then deleted: what the first compile of a process brings in whatever
    the model (code paths, runtime pools, freed heap a later compile reuses) is then in the baseline,
    so the figure is what this model adds. `quantized`: one of `QUANTIZED`'s contenders, loaded that way
    (quantised as it loads), or "sf_int8_saved": `sf_int8` saved once and loaded from its int8 folder."""
    import gc

    import psutil

    from staticformers import AutoConfig, AutoModelForCausalLM
    from staticformers.generation.engines import engine_for

    dtype = getattr(torch, dtype_name)
    torch.compile(lambda x: x * 2, backend="inductor", fullgraph=True)(torch.ones(8))
    if baseline == "library":
        cfg = AutoConfig.for_model(
            "qwen3",
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
        )
        tiny = AutoModelForCausalLM.from_config(cfg, seed=0).to(dtype)
        tiny.generate(input_ids=torch.randint(1, 256, (batch, PROMPT)), max_new_tokens=4, do_sample=False)
        del tiny
        gc.collect()
    base = psutil.Process().memory_info().rss
    if quantized == "sf_int8_saved":  # an int8 folder saved once by the parent: loaded as it is stored
        sf = AutoModelForCausalLM.from_pretrained(os.environ[SAVED_ENV], dtype=dtype)
    elif quantized:
        from staticformers import QuantizationConfig

        sf = AutoModelForCausalLM.from_pretrained(
            REF_DIR, dtype=dtype, quantization_config=QuantizationConfig(**QUANTIZED[quantized])
        )
    else:
        sf = AutoModelForCausalLM.from_pretrained(REF_DIR, dtype=dtype)
    ids = torch.randint(1, int(_config(REF_DIR)["vocab_size"]), (batch, PROMPT))
    sf.generate(input_ids=ids, max_new_tokens=NEW, do_sample=False)  # compile (or warm cache)
    with PeakRSS() as peak:
        sf.generate(input_ids=ids, max_new_tokens=NEW, do_sample=False)
    weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in sf.parameters()}.values())
    kv = sum(c.nbytes for c in engine_for(sf).caches.values())
    used = peak.peak - base
    return {
        "dtype": dtype_name,
        "batch": batch,
        "baseline": baseline,
        "quantized": quantized or None,
        "weights_mb": round(weights / 2**20, 1),
        "kv_mb": round(kv / 2**20, 1),
        "peak_over_baseline_mb": round(used / 2**20, 1),
        "ratio": round(used / (weights + kv), 2),
    }


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

        def run(ids):
            return model.generate(input_ids=ids, max_new_tokens=16, do_sample=False)
    else:
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(REF_DIR, dtype=dtype).eval()
        cc = transformers.CompileConfig(dynamic=False)  # its default fullgraph=False: past the limit it runs eager
        cc._compile_all_devices = True

        def run(ids):
            return model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=16,
                do_sample=False,
                cache_implementation="static",
                compile_config=cc,
            )

    load = time.perf_counter() - t0
    vocab = int(_config(REF_DIR)["vocab_size"])
    t0 = time.perf_counter()
    for n in MIXED_LENGTHS:
        run(torch.randint(1, vocab, (1, n)))
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for n in MIXED_LENGTHS:
        run(torch.randint(1, vocab, (1, n)))
    second = time.perf_counter() - t0
    out = {
        "who": who,
        "dtype": dtype_name,
        "graphs": int(counters["stats"]["unique_graphs"]),
        "frames_ok": int(counters["frames"]["ok"]),
        "first_pass_s": round(first, 2),
        "second_pass_s": round(second, 2),
        "compile_s_estimate": round(first - second, 2),
        "load_s": round(load, 2),
    }
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N: both contenders run there")
    ap.add_argument(
        "--size",
        default=None,
        choices=sorted(SIZES),
        help="reference checkpoint (bench/reference.py); default 41m, or $STATICFORMERS_BENCH_MODEL",
    )
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--prompt", type=int, default=PROMPT, help="prompt tokens")
    ap.add_argument("--new", type=int, default=NEW, help="new tokens per generate")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--matmul-n",
        type=int,
        default=None,
        help="the matmul ceiling's n (an n x n x n matmul; default 8192 on a GPU, 1024 on the CPU)",
    )
    ap.add_argument(
        "--which",
        nargs="+",
        default=["hf", "hf_static", "sf"],
        help="contenders: hf, hf_static, sf, torchao_int8 (torchao's int8 on hf_static), and on the CPU "
        "openvino, openvino_int8 (the openvino extra)",
    )
    ap.add_argument(
        "--compile-mode",
        default=None,
        help="staticformers' CompileConfig(mode=...), e.g. reduce-overhead (CUDA graphs)",
    )
    ap.add_argument(
        "--backend",
        default="inductor",
        help="compile backend of sf and hf_static, and on the CPU of the memory ceiling's compiled probe "
        "(eager / aot_eager for a quick dry run)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads of every contender (default: the library's choice, the CPUs this process may "
        "use; or $STATICFORMERS_NUM_THREADS)",
    )
    ap.add_argument("--out", default=None, help="also write the JSON here, after every case")
    ap.add_argument("--mixed", action="store_true", help="measure compile counts/seconds for mixed prompt lengths")
    ap.add_argument("--memory", action="store_true", help="measure peak memory of staticformers")
    ap.add_argument("--_mixed_case", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--_memory_case", nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--cpu-backend", default="eager", help="--device xla: the compile backend of the CPU contender")
    ap.add_argument(
        "--quantization",
        choices=["int8"],
        default=None,
        help="add our weight-only int8 contenders (sf_int8: head exact; sf_int8_head: head int8 too) "
        "beside sf, with an int8 same-bytes probe; with --memory, their peak memory too",
    )
    args = ap.parse_args(argv)
    if args.device.split(":")[0] == "xla":  # its own script: it runs in the XLA environment (bench/generate_xla.py)
        from generate_xla import main as xla_main

        return xla_main(args)
    if args.quantization:
        args.which = list(args.which) + [n for n in QUANTIZED if n not in args.which]
    device = check_device(args.device)
    if not (args.mixed or args.memory):
        openvino_peer.check(args.which, args.dtypes, device.type)
    if (args.mixed or args.memory) and device.type != "cpu":
        raise SystemExit(
            "--mixed and --memory measure the CPU (RSS, fresh processes): drop --device or pass --device cpu."
        )
    global REF_DIR
    if args.size is not None:
        REF_DIR = reference_dir(args.size)
    size = args.size or ("41m" if REF_DIR == reference_dir("41m") else None)
    if device.type == "cpu":  # the library's own choice (the CPUs this process may use), or --threads
        from staticformers.utils.cpus import choose_threads

        torch.set_num_threads(choose_threads(args.threads).threads)
    if size is not None:
        build_reference(REF_DIR, size=size, device=str(device))
    if args._mixed_case:
        print(json.dumps(mixed_case(*args._mixed_case)))
        return
    if args._memory_case:
        print(json.dumps(memory_case(args._memory_case[0], int(args._memory_case[1]), *args._memory_case[2:])))
        return
    report = {
        "device": device_info(device),
        "model": REF_DIR,
        "size": size,
        "compile_mode": args.compile_mode,
        "backend": args.backend,
        "hf_static_compile": "transformers' automatic (inductor, reduce-overhead)"
        if device.type == "cuda" and args.backend == "inductor"
        else "forced: fullgraph=True, dynamic=False",
        "pressure_before": pressure(),
        "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "cases": [],
    }
    env = dict(os.environ, STATICFORMERS_BENCH_MODEL=REF_DIR)
    if args.mixed:

        def fresh_cache_env() -> dict:  # an empty compile cache (inductor's kernels, ISA probes, headers)
            cache = tempfile.mkdtemp(prefix="sf-bench-cache-")
            return dict(env, STATICFORMERS_CACHE=cache, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"))

        for dtype in args.dtypes:
            if "hf_static" in args.which or "hf" in args.which:
                report["cases"].append(_subprocess(["--_mixed_case", "hf", dtype], fresh_cache_env()))
            if "sf" in args.which:
                cold = fresh_cache_env()
                report["cases"].append(_subprocess(["--_mixed_case", "sf", dtype], cold))  # cold
                report["cases"].append(_subprocess(["--_mixed_case", "sf", dtype], cold))  # warm on-disk cache
    elif args.memory:
        for dtype in args.dtypes:
            for batch in args.batches:
                for baseline in ("compiler", "library"):
                    report["cases"].append(_subprocess(["--_memory_case", dtype, str(batch), baseline], env))
                    for name in [*QUANTIZED, "sf_int8_saved"] if args.quantization else ():
                        if name == "sf_int8_saved" and SAVED_ENV not in env:
                            env[SAVED_ENV] = save_int8(dtype)
                        report["cases"].append(_subprocess(["--_memory_case", dtype, str(batch), baseline, name], env))
                if SAVED_ENV in env:  # saved per dtype
                    shutil.rmtree(env.pop(SAVED_ENV), ignore_errors=True)
    else:
        weights = _weight_elements(REF_DIR)  # elements read per decode step
        cols = int(_config(REF_DIR)["hidden_size"])
        report["ceilings"], memory = {}, {}
        for dtype in args.dtypes:  # the weights' bytes in each dtype, read by each probe in that dtype
            dt = getattr(torch, dtype)
            memory[dtype] = MemoryCeiling(device, weights * dt.itemsize, dt, cols, backend=args.backend)
            memory[dtype].sample()
            report["ceilings"][dtype] = {
                "memory": memory[dtype].result(),
                "matmul": matmul_ceiling(device, args.matmul_n, dt),
            }
        if args.quantization:  # the same-bytes probe of the int8 weights (one byte an element)
            memory["int8"] = MemoryCeiling(device, weights, torch.int8, cols, backend=args.backend)
            memory["int8"].sample()
        for dtype in args.dtypes:
            for batch in args.batches:
                report["cases"].append(
                    bench_case(
                        dtype,
                        batch,
                        args.repeats,
                        args.which,
                        device,
                        REF_DIR,
                        args.prompt,
                        args.new,
                        args.compile_mode,
                        args.backend,
                        report["ceilings"][dtype],
                        memory[dtype],
                    )
                )
                if "int8" in memory:
                    memory["int8"].sample()
                _write(report, args.out)
        for dtype in args.dtypes:  # a last sample, then every case against the run's best
            memory[dtype].sample()
            report["ceilings"][dtype]["memory"] = memory[dtype].result()
            memory[dtype].close()
        if "int8" in memory:
            memory["int8"].sample()
            for dtype in args.dtypes:
                report["ceilings"][dtype]["int8_memory"] = memory["int8"].result()
            memory["int8"].close()
        for case in report["cases"]:
            add_utilisation(case, report["ceilings"][case["dtype"]])
    report["pressure_after"] = pressure()
    _write(report, args.out)
    print(json.dumps(report, indent=1))


def _weight_elements(ref_dir: str) -> int:
    """Weight elements a decode step reads (see `weights_read_per_step`), from a meta-device model of the config."""
    from staticformers import AutoConfig, CausalLM

    with torch.device("meta"):
        model = CausalLM(AutoConfig.from_pretrained(ref_dir))
    return weights_read_per_step(model) // model.dtype.itemsize


def _write(report: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
