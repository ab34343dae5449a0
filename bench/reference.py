"""The reference checkpoint every benchmark uses (Qwen3-shaped, 41.6M parameters, built here), and the
CPU-pressure reading every benchmark records.

hidden 512, intermediate 1536, 8 layers, 8 heads, 4 KV heads, head_dim 64, vocab 32000, tied
embeddings, no EOS token (so generation benchmarks always produce every token they ask for). Built with staticformers' own random init and saved in Hugging Face format, once per
folder (a marker file records the config), so every script and the peer load the same weights.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

# this checkout's package, unless one is importable already (installed, or a tree the caller put first:
# an A/B of two trees must not silently run this one)
if importlib.util.find_spec("staticformers") is None:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

REFERENCE = dict(
    vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
    num_key_value_heads=4, head_dim=64, tie_word_embeddings=True, max_position_embeddings=4096,
    rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None, pad_token_id=0,
)  # no EOS: every generation benchmark makes all its tokens
DEFAULT_DIR = os.path.join(os.path.dirname(__file__), "results", "reference-qwen3-41m")


def pressure() -> str:
    """The first line of /proc/pressure/cpu ("some avg10=..."): every benchmark records it."""
    try:
        with open("/proc/pressure/cpu") as f:
            return f.readline().strip()
    except OSError:
        return "n/a"


def build_reference(directory: str = DEFAULT_DIR, dtype: str = "float32", seed: int = 0) -> str:
    """Save the reference checkpoint in `dtype` to `directory` unless it is already there; return the folder."""
    import torch

    from staticformers import AutoConfig, AutoModelForCausalLM

    marker = os.path.join(directory, "reference.json")
    want = {"config": REFERENCE, "dtype": dtype, "seed": seed}
    if os.path.exists(marker):
        with open(marker) as f:
            if json.load(f) == want:
                return directory
    config = AutoConfig.for_model("qwen3", **REFERENCE)
    model = AutoModelForCausalLM.from_config(config, seed=seed).to(getattr(torch, dtype))
    model.save_pretrained(directory)
    with open(marker, "w") as f:
        json.dump(want, f)
    return directory


if __name__ == "__main__":
    print(build_reference(*(sys.argv[1:2] or [DEFAULT_DIR])))
