"""llama.cpp (through llama-cpp-python) as a peer of bench/peers.py: its GGUF files and its child process.

Two halves, because they run in two environments:

- **The files** (`make_gguf`, in the main venv, with the `gguf` package our loader uses). llama.cpp needs the
  model at the precision it is compared at, and the file the suite ships is Q4_1. Each format is written from
  the *dequantised* model, tensor by tensor: every tensor of the Q4_1 file is dequantised to float32 by
  `gguf.quants.dequantize` (the call our `checkpoints/gguf_file.py` makes, so these are the values our engine and
  transformers load), then written as F32, F16 (numpy's rounding), BF16 or Q8_0 (`gguf.quants.quantize`,
  ggml's own block format, 32 values and one f16 scale a block) with `GGUFWriter`, every metadata key copied
  except `general.file_type`, which names the new format. One-dimensional tensors (the norms) stay F32 in every
  format, as llama.cpp's converter and `llama-quantize` keep them. The F32 file thus holds exactly the values
  our fp32 model holds; F16, BF16 and Q8_0 round those values once. Chosen over llama-cpp-python's bundled
  `llama_model_quantize` (which would requantise Q4_1 -> F32 -> the others just as well) so that the files are
  made, and tested, without the peer's venv, from the very arrays our loader dequantises.
- **The child** (`python bench/llama_cpp_peer.py --child SPEC`, in the peer's venv, which has llama_cpp and
  numpy and no torch). It loads the GGUF with llama.cpp's C API through llama-cpp-python's ctypes bindings
  (`llama_model_load_from_file`, `llama_init_from_model`, `llama_decode`), and generates greedily: the prompt
  of every row in one `llama_batch` (each row its own sequence id), then one batch of one token per row per
  step, the next token the argmax of that row's logits. Batches above 1 use the same loop: llama.cpp's C API
  decodes several sequences at once (`n_seq_max`, one KV stream per sequence, `kv_unified=False`);
  llama-cpp-python's `Llama` class does not (one sequence), which is why the child drives the C API.
  The KV cache is kept in the file's precision (F32, F16, BF16; F16, llama.cpp's default, for Q8_0). No EOS
  stops a row: every run makes every token it is asked for, as the other engines do with `eos_token_id=None`.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time

FORMATS = ("F32", "F16", "BF16", "Q8_0")
FILE_TYPES = {"F32": 0, "F16": 1, "Q8_0": 7, "BF16": 32}  # gguf.LlamaFileType: ALL_F32, MOSTLY_F16, ...
KV_TYPES = {"F32": 0, "F16": 1, "BF16": 30, "Q8_0": 1}  # ggml_type of the KV cache: f32, f16, bf16, f16


def gguf_name(source_name: str, fmt: str) -> str:
    """`SmolLM2-135M-Instruct.Q4_1.gguf` -> `SmolLM2-135M-Instruct.F32.gguf`."""
    if fmt not in FORMATS:
        raise ValueError(f"llama.cpp format {fmt!r}: use one of {', '.join(FORMATS)}.")
    stem = source_name.removesuffix(".gguf")
    base, dot, _quant = stem.rpartition(".")
    return f"{base if dot else stem}.{fmt}.gguf"


def make_gguf(source: str, dest: str, fmt: str) -> dict:
    """Write `source`'s model, dequantised, as a `fmt` GGUF at `dest` (atomically: a temporary file renamed);
    what it holds: {"format", "bytes", "tensor_types": {type: count}, "seconds"}."""
    import gguf
    import numpy as np

    if fmt not in FORMATS:
        raise ValueError(f"llama.cpp format {fmt!r}: use one of {', '.join(FORMATS)}.")
    t0 = time.perf_counter()
    qtype = getattr(gguf.GGMLQuantizationType, fmt)
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    tmp = dest + ".partial"
    writer = gguf.GGUFWriter(tmp, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    writer.add_file_type(FILE_TYPES[fmt])
    types: dict[str, int] = {}
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        kind = qtype if values.ndim > 1 else gguf.GGMLQuantizationType.F32
        if kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(tensor.name, np.ascontiguousarray(values))
        elif kind == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(tensor.name, values.astype(np.float16))
        else:  # BF16, Q8_0: ggml's bytes, shape given back from them
            writer.add_tensor(tensor.name, gguf.quants.quantize(values, kind), raw_dtype=kind)
        types[kind.name] = types.get(kind.name, 0) + 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, dest)
    return {
        "format": fmt,
        "bytes": os.path.getsize(dest),
        "tensor_types": types,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def weight_bytes(path: str) -> int:
    """Bytes of every tensor in a GGUF (the tied embedding is the head: read whole every step, counted once)."""
    import gguf

    return int(sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors))


# ---------------------------------------------------------------------------------------------
# the child, in the peer's venv (llama_cpp and numpy only)
# ---------------------------------------------------------------------------------------------
def cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


class Generator:
    """One llama.cpp model and context with room for `batch` sequences of `prompt + new` tokens."""

    def __init__(self, path: str, fmt: str, batch: int, prompt: int, new: int, threads: int):
        import llama_cpp as L

        self.L, self.batch, self.prompt = L, batch, prompt
        L.llama_log_set(_QUIET, None)
        L.llama_backend_init()
        mparams = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(path.encode(), mparams)
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {path}")
        cparams = L.llama_context_default_params()
        per_seq = prompt + new + 1
        cparams.n_seq_max = batch
        cparams.kv_unified = False  # a KV stream per sequence: each row attends over its own positions only
        cparams.n_ctx = batch * ((per_seq + 255) // 256 * 256)
        cparams.n_batch = max(batch * prompt, batch, 512)
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.type_k = cparams.type_v = KV_TYPES[fmt]
        cparams.no_perf = True
        self.ctx = L.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise SystemExit(f"llama.cpp could not make a context for {path} (n_ctx {cparams.n_ctx}, batch {batch})")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.cbatch = L.llama_batch_init(cparams.n_batch, 0, batch)
        self.params = {
            "n_ctx": cparams.n_ctx,
            "n_batch": cparams.n_batch,
            "n_ubatch": cparams.n_ubatch,
            "n_seq_max": batch,
            "kv_unified": False,
            "threads": threads,
            "kv_type": KV_TYPES[fmt],
            "flash_attn_type": cparams.flash_attn_type,
            "system_info": L.llama_print_system_info().decode(errors="replace").strip(),
        }

    def _decode(self, rows: list[list[int]], start: int) -> list[int]:
        """Each row's tokens at positions start.. as sequence i; the argmax of each row's last logits."""
        import numpy as np

        L, b = self.L, self.cbatch
        n, last = 0, []
        for seq, tokens in enumerate(rows):
            for j, tok in enumerate(tokens):
                b.token[n], b.pos[n], b.n_seq_id[n] = tok, start + j, 1
                b.seq_id[n][0] = seq
                b.logits[n] = j == len(tokens) - 1
                n += 1
            last.append(n - 1)
        b.n_tokens = n
        rc = L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        out = []
        for i in last:
            logits = np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
            out.append(int(logits.argmax()))
        return out

    def generate(self, ids: list[list[int]], new: int) -> list[list[int]]:
        """`new` greedy tokens per row after `ids` (rows of `prompt` tokens), from an empty KV cache."""
        L = self.L
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        nxt = self._decode(ids, 0)
        out = [[t] for t in nxt]
        for step in range(1, new):
            nxt = self._decode([[t] for t in nxt], self.prompt + step - 1)
            for row, t in zip(out, nxt):
                row.append(t)
        return out


@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
def _QUIET(level, text, data):
    """llama.cpp's log callback: its load messages dropped (the child's stdout is its JSON)."""


def child(spec: dict) -> dict:
    """Run one timed process: load, first token, warm-up, then `repeats` of (1 token, `new` tokens)."""
    t_start = time.time()
    from importlib.metadata import version

    import llama_cpp

    t_imported = time.time()
    with open(spec["prompt_file"]) as f:
        ids = json.load(f)[: spec["batch"]]
    prompt, new, batch = len(ids[0]), spec["new"], spec["batch"]
    gen = Generator(spec["model"], spec["format"], batch, prompt, new, spec.get("threads") or cpus())
    t_loaded = time.time()
    gen.generate(ids, 1)
    t_first = time.time()
    w0 = time.perf_counter()
    tokens = gen.generate(ids, new)
    gen.generate(ids, 1)
    warmup = time.perf_counter() - w0
    ttft, total = [], []
    for _ in range(spec["repeats"]):
        t = time.perf_counter()
        gen.generate(ids, 1)
        ttft.append(time.perf_counter() - t)
        t = time.perf_counter()
        out = gen.generate(ids, new)
        total.append(time.perf_counter() - t)
        assert len(out) == batch and all(len(r) == new for r in out)
    return {
        "t_start": t_start,
        "t_imported": t_imported,
        "t_loaded": t_loaded,
        "t_first_token": t_first,
        "warmup_s": warmup,
        "ttft_s": ttft,
        "total_s": total,
        "tokens": tokens[0],
        "versions": {"llama-cpp-python": version("llama_cpp_python"), "llama_cpp": llama_cpp.__version__},
        "llama_cpp": gen.params,
    }


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(child(json.loads(sys.argv[2]))))
    else:
        raise SystemExit("usage: python bench/llama_cpp_peer.py --child SPEC_JSON (run by bench/peers.py)")
