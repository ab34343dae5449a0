"""The reference checkpoints every benchmark uses (Qwen3-shaped, random weights, built here: nothing is
downloaded), and the CPU-pressure reading every benchmark records.

Sizes (`--size`):
- `41m` (the default): hidden 512, intermediate 1536, 8 layers, 8 heads, 4 KV heads, head_dim 64,
  vocab 32000, tied; 41.6M parameters, float32 on disk. Fits in a CPU's L3, and is launch-bound on a GPU.
- `1.7b`: Qwen3-1.7B's shape (hidden 2048, intermediate 6144, 28 layers, 16 heads, 8 KV heads,
  head_dim 128, vocab 151,936, tied, RoPE theta 1e6); 1.72B parameters, bfloat16 on disk (3.4 GB).
  Built on the device it will run on (`--device cuda`): random init of 1.7B values is a second there.
- `tiny`: hidden 64, 2 layers, vocab 512: the dry runs of `bench/device_check.sh` and the tests.
- `moe50m`: Qwen3-MoE-shaped: hidden 512, 6 layers, every one a mixture of 8 experts (top-2, renormalised,
  expert width 384), 8 heads, 4 KV heads, head_dim 64, vocab 32000, tied; 49.4M parameters (28.2M a token
  goes through: its top-2 experts, attention, the tied head), float32 on disk.
- `gptoss50m`: gpt-oss-shaped, the size of `moe50m`: hidden 512, 6 layers alternating sliding (window 128)
  and full attention with sinks, 8 experts (top-2, biased, the clamped SwiGLU, width 384), 8 heads, 2 KV
  heads, head_dim 64, YaRN, vocab 32000, untied; float32 on disk.
- `qwen3_5-50m`: Qwen3.5-text-shaped: hidden 512, 8 layers (6 Gated DeltaNet: 4 key heads and 8 value heads of
  64, kernel 4; then every fourth a gated full-attention layer: 8 heads, 2 KV heads, head_dim 64, a quarter
  rotating), MLP width 1536, vocab 32000, tied; float32 on disk.
- `gemma3-50m`: Gemma-3-text-shaped: hidden 512, 6 layers (5 sliding with window 128, then 1 full; two RoPE
  bases), q/k norm, four norms per layer, GELU-tanh, 8 heads, 4 KV heads, head_dim 64, MLP width 1536, and
  Gemma 3's 262,144-token vocabulary, tied (the head is most of the weights, as in the small Gemma 3s);
  float32 on disk.

Every size has no EOS token, so generation benchmarks always produce every token they ask for.
Each is saved in Hugging Face format once per folder (a marker file records config, dtype, seed and
the device kind it was drawn on), so every script and the peer load the same weights.

    python bench/reference.py --size 1.7b --device cuda      # prints the folder
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

# this checkout's package, unless one is importable already (installed, or a tree the caller put first:
# an A/B of two trees must not silently run this one)
if importlib.util.find_spec("staticformers") is None:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

_COMMON = dict(bos_token_id=None, eos_token_id=None, pad_token_id=0, rms_norm_eps=1e-6, tie_word_embeddings=True)
SIZES = {
    "41m": dict(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=4096,
        **_COMMON,
    ),
    "1.7b": dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=4096,
        rope_theta=1000000.0,
        **_COMMON,
    ),
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        **_COMMON,
    ),
    "moe50m": dict(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=4096,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=384,
        norm_topk_prob=True,
        **_COMMON,
    ),
}
SIZES["gptoss50m"] = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=384,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=4096,
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=128,
    **{**_COMMON, "tie_word_embeddings": False},
)
SIZES["gemma3-50m"] = dict(
    vocab_size=262144,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=4096,
    sliding_window=128,
    query_pre_attn_scalar=64,
    **_COMMON,
)
SIZES["qwen3_5-50m"] = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=4096,
    linear_num_key_heads=4,
    linear_key_head_dim=64,
    linear_num_value_heads=8,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    **_COMMON,
)
DEFAULT_DTYPES = {
    "41m": "float32",
    "1.7b": "bfloat16",
    "tiny": "float32",
    "moe50m": "float32",
    "gptoss50m": "float32",
    "gemma3-50m": "float32",
    "qwen3_5-50m": "float32",
}
MODEL_TYPES = {
    "moe50m": "qwen3_moe",
    "gptoss50m": "gpt_oss",
    "gemma3-50m": "gemma3_text",
    "qwen3_5-50m": "qwen3_5_text",
}  # every other size is a Qwen3
REFERENCE = SIZES["41m"]  # the name earlier scripts import
MODELS_ENV = "STATICFORMERS_BENCH_MODELS"  # where reference folders go (default bench/results)


def reference_dir(size: str = "41m") -> str:
    """The folder of a size's checkpoint: `$STATICFORMERS_BENCH_MODELS` or bench/results, then reference-qwen3-<size>."""
    check_size(size)
    root = os.environ.get(MODELS_ENV) or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    return os.path.join(root, f"reference-qwen3-{size}")


DEFAULT_DIR = os.path.join(os.path.dirname(__file__), "results", "reference-qwen3-41m")


def check_size(size: str) -> None:
    if size not in SIZES:
        raise ValueError(f"Unknown reference size {size!r}: use one of {', '.join(SIZES)}.")


def pool_blocks(batch: int, prompt: int, new: int, size: int = 32) -> int:
    """Blocks of `size` positions that hold every row's prompt and new tokens, plus the pool's null block: a pool in
    which no row is ever preempted."""
    return batch * -(-(prompt + new) // size) + 1


def emit(report: dict, out: str | None) -> None:
    """Print a benchmark's report as JSON, and write it to `out` too where one is given."""
    text = json.dumps(report, indent=1)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    print(text)


def pressure() -> str:
    """The first line of /proc/pressure/cpu ("some avg10=..."): every benchmark records it."""
    try:
        with open("/proc/pressure/cpu") as f:
            return f.readline().strip()
    except OSError:
        return "n/a"


def real_model() -> tuple[str, str]:
    """(the folder holding the suite's real model, SmolLM2-135M-Instruct's GGUF, and the file's name), installed
    on first use (`tests/real_model_cache.py`); exits saying why where it cannot be."""
    tests = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")
    if tests not in sys.path:
        sys.path.append(tests)
    from real_model_cache import GGUF_NAME, installed_gguf

    folder, why = installed_gguf()
    if folder is None:
        raise SystemExit(f"the real model is not available: {why}.")
    return str(folder), GGUF_NAME


def report(result: dict, out) -> None:
    """A benchmark's JSON, printed, and written to `out` when given: every benchmark ends this way."""
    text = json.dumps(result, indent=1)
    print(text)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            f.write(text)


def reference_config(size: str = "41m"):
    """The size's staticformers ModelConfig (a Qwen3 config, Qwen3-MoE for `moe50m`, gpt-oss for `gptoss50m`,
    Gemma 3 text for `gemma3-50m`, Qwen3.5 text for `qwen3_5-50m`)."""
    from staticformers import AutoConfig

    check_size(size)
    return AutoConfig.for_model(MODEL_TYPES.get(size, "qwen3"), **SIZES[size])


def weight_counts(size: str = "41m") -> dict:
    """Parameters of a size (tied weights once) and those a token is multiplied by (`linear_parameters`:
    the linear layers, the lm_head included, and of a mixture's stacked experts the top_k / E a token
    goes through; the embedding is a lookup unless tied), from a model built on the meta device (no
    memory, no init)."""
    import torch

    from staticformers import CausalLM
    from staticformers.models.moe import Experts

    config = reference_config(size)
    with torch.device("meta"):
        model = CausalLM(config)
    params = {id(p): p for p in model.parameters()}
    linear = {id(m.weight): m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)}
    experts = sum(p.numel() for m in model.modules() if isinstance(m, Experts) for p in m.parameters())
    active = experts * config.num_experts_per_tok // config.num_experts if experts else 0
    return {
        "parameters": sum(p.numel() for p in params.values()),
        "linear_parameters": sum(w.numel() for w in linear.values()) + active,
    }


def build_reference(
    directory: str | None = None, dtype: str | None = None, seed: int = 0, size: str = "41m", device: str = "cpu"
) -> str:
    """Save the `size` checkpoint in `dtype` to `directory` unless it is already there; return the folder.

    The weights are drawn on `device` (a GPU builds the 1.7B model in a second; the CPU's and a GPU's
    random streams differ, so the marker records the device kind)."""
    import torch

    from staticformers import AutoModelForCausalLM

    check_size(size)
    directory = directory or reference_dir(size)
    dtype = dtype or DEFAULT_DTYPES[size]
    marker = os.path.join(directory, "reference.json")
    want = {"config": SIZES[size], "dtype": dtype, "seed": seed}
    kind = torch.device(device).type
    if kind != "cpu":
        want["drawn_on"] = kind
    if os.path.exists(marker):
        with open(marker) as f:
            if json.load(f) == want:
                return directory
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(reference_config(size), seed=seed)
    model = model.to(device=device, dtype=getattr(torch, dtype))
    model.save_pretrained(directory)
    with open(marker, "w") as f:
        json.dump(want, f)
    return directory


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("directory", nargs="?", default=None, help="where to save (default: reference_dir(size))")
    ap.add_argument("--size", default="41m", choices=sorted(SIZES))
    ap.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: the size's)")
    ap.add_argument("--device", default="cpu", help="where the random weights are drawn: cpu, cuda, cuda:N")
    a = ap.parse_args(argv)
    print(build_reference(a.directory, a.dtype, size=a.size, device=a.device))


if __name__ == "__main__":
    main()
