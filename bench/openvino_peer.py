"""OpenVINO through optimum-intel as a CPU peer of `bench/generate.py` (contenders `openvino`, `openvino_int8`).

Why a module of its own: it is the fastest CPU peer we could install, and it needs packages (the `bench`
extra's `optimum-intel[openvino]` and `openvino`) that the rest of the bench does not, so everything that
touches them is here and imported only when one of its contenders is asked for.

- The reference checkpoint is exported once per folder (`text-generation-with-past`, the export
  `optimum-cli export openvino` does), kept beside it as `<reference>-openvino/{fp,int8}`, reused while
  the marker (optimum-intel's and openvino's versions, the compression) matches.
- `openvino`: the weights as stored (fp32), no weight compression (optimum-intel would compress a model
  over 1B parameters to int8 by itself; `load_in_8bit=False` says not to).
- `openvino_int8`: its weight-only int8 (NNCF's `OVWeightQuantizationConfig(bits=8, sym=True)`: per
  output channel, symmetric, like ours). NNCF compresses the embedding and the tied head too, so it is
  the peer of `sf_int8_head` more than of `sf_int8`.
- The precision is pinned: `INFERENCE_PRECISION_HINT` is `f32` for a float32 case and `bf16` for a
  bfloat16 case. OpenVINO's default on a bf16-capable CPU is bf16, so an unpinned fp32 comparison would
  not be like for like. Its threads are the process's CPU count, as torch's are in the bench.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

CONTENDERS = ("openvino", "openvino_int8")
PRECISION_HINTS = {"float32": "f32", "bfloat16": "bf16"}
INSTALL = "pip install -e '.[openvino]' in a venv of its own (optimum-intel 2.2 needs transformers<5.6)"


def available() -> bool:
    """Whether optimum-intel's OpenVINO models can be imported here."""
    try:
        import openvino  # noqa: F401
        from optimum.intel import OVModelForCausalLM  # noqa: F401
    except ImportError:
        return False
    return True


def check(which: list[str], dtypes: list[str], device_type: str) -> None:
    """One sentence, and exit, for an OpenVINO contender this run cannot have."""
    asked = [n for n in which if n in CONTENDERS]
    if not asked:
        return
    if device_type != "cpu":
        raise SystemExit(f"--which {' '.join(asked)} runs on the CPU only: drop it or pass --device cpu.")
    bad = [d for d in dtypes if d not in PRECISION_HINTS]
    if bad:
        raise SystemExit(
            f"--which {' '.join(asked)} pins INFERENCE_PRECISION_HINT for float32 or bfloat16 only, "
            f"not {', '.join(bad)}: drop it or pass --dtypes float32 bfloat16."
        )
    if not available():
        raise SystemExit(
            f"--which {' '.join(asked)} needs optimum-intel with OpenVINO, not importable here: {INSTALL}."
        )


def _versions() -> dict:
    from importlib.metadata import version

    return {"optimum-intel": version("optimum-intel"), "openvino": version("openvino")}


def export(ref_dir: str, int8: bool) -> tuple[str, float]:
    """The OpenVINO export of `ref_dir` (int8 weights or not), made once: (its folder, seconds it took, 0 if reused)."""
    from optimum.intel import OVModelForCausalLM, OVWeightQuantizationConfig

    out = os.path.join(ref_dir.rstrip("/") + "-openvino", "int8" if int8 else "fp")
    marker = dict(_versions(), weights="int8_sym_per_channel" if int8 else "as_stored")
    marker_path = os.path.join(out, "staticformers-bench.json")
    if os.path.exists(marker_path):
        with open(marker_path) as f:
            if json.load(f) == marker:
                return out, 0.0
    t0 = time.perf_counter()
    kwargs = (
        dict(quantization_config=OVWeightQuantizationConfig(bits=8, sym=True)) if int8 else dict(load_in_8bit=False)
    )
    with _stdout_to_stderr():  # NNCF prints its tables to stdout, which is the bench's JSON
        model = OVModelForCausalLM.from_pretrained(ref_dir, export=True, compile=False, **kwargs)
        model.save_pretrained(out)
    seconds = time.perf_counter() - t0
    with open(marker_path, "w") as f:
        json.dump(marker, f)
    return out, seconds


@contextlib.contextmanager
def _stdout_to_stderr():
    """File descriptor 1 pointed at 2 while the block runs (NNCF's logger and progress bar hold sys.stdout)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def load(folder: str, dtype_name: str):
    """The exported model compiled for the CPU with its precision pinned to the case's dtype."""
    from optimum.intel import OVModelForCausalLM

    ov_config = {
        "INFERENCE_PRECISION_HINT": PRECISION_HINTS[dtype_name],
        "PERFORMANCE_HINT": "LATENCY",
        "INFERENCE_NUM_THREADS": str(os.cpu_count() or 1),
        "CACHE_DIR": "",
    }
    return OVModelForCausalLM.from_pretrained(folder, device="CPU", ov_config=ov_config)


def weight_file_bytes(folder: str) -> int:
    """Bytes of the exported weights on disk (openvino_model.bin)."""
    return os.path.getsize(os.path.join(folder, "openvino_model.bin"))


def make_runners(dtype_name: str, which: list[str], ref_dir: str, ids, mask) -> tuple[dict, dict]:
    """name -> fn(max_new_tokens) for the OpenVINO contenders in `which`, and what each one's record adds
    (its export's seconds, its weight file's bytes, the precision hint)."""
    runners, info = {}, {}
    for name in CONTENDERS:
        if name not in which:
            continue
        folder, seconds = export(ref_dir, int8=name == "openvino_int8")
        model = load(folder, dtype_name)
        runners[name] = (
            lambda m: lambda n: m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False)
        )(model)
        info[name] = {
            "export_seconds": round(seconds, 1),
            "weight_file_bytes": weight_file_bytes(folder),
            "precision_hint": PRECISION_HINTS[dtype_name],
            **_versions(),
        }
    return runners, info
