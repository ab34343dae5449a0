"""What one request's cache costs at a given context: a reference size as it is, against the same model with every
layer full attention (a pure-attention model of the same width), from the cache's own accounting
(`models/kv_cache.py`: `bytes_per_position`, `state_bytes_per_row`, and `KVCache.bytes_for`, which the memory check
reads: it adds a hybrid row's counted-token index), checked against the buffers a cache of that shape allocates.
JSON out.

Why this exists: a hybrid's linear-attention layers (Qwen3.5's Gated DeltaNet) keep a fixed-size state per
request instead of keys and values per position, and a latent-attention model (DeepSeek-V3) keeps one latent
per position; the saving is the point of those architectures, so it is measured, not asserted from a formula.

    python bench/state_bytes.py --size qwen3_5-50m --context 4096 --out bench/results/state-bytes-qwen3_5-50m.json
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from reference import SIZES, reference_config, report


def cache_bytes(config, context: int, dtype: torch.dtype) -> dict:
    """One request's cache at `context` positions: the positions' keys and values, the fixed-size states, and the
    bytes a cache of one row allocates (built on the meta device: no memory)."""
    from staticformers import CausalLM
    from staticformers.models.kv_cache import KVCache, bytes_per_position, state_bytes_per_row

    with torch.device("meta"):
        model = CausalLM(config).to(dtype)
    allocated = KVCache.for_model(model, batch=1, max_length=context).nbytes
    accounted = KVCache.bytes_for(model, batch=1, max_length=context)
    if allocated != accounted:
        raise SystemExit(
            f"The cache allocates {allocated} bytes, not the {accounted} its accounting says: fix models/kv_cache.py."
        )
    per_position = bytes_per_position(config, dtype)
    # the fixed-size part: the linear layers' states and a hybrid row's counted-token index
    return {
        "per_position": per_position,
        "states": state_bytes_per_row(config, dtype),
        "fixed": allocated - per_position * context,
        "total": allocated,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="qwen3_5-50m", choices=sorted(SIZES))
    ap.add_argument("--context", type=int, default=4096, help="positions a request holds")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.context < 1:
        ap.error(f"--context {args.context}: a request holds at least one position.")
    dtype = getattr(torch, args.dtype)
    config = reference_config(args.size)
    ours = cache_bytes(config, args.context, dtype)
    result = {"size": args.size, "context": args.context, "dtype": args.dtype, "model": ours}
    if config.has_linear_attention:
        full = dataclasses.replace(config, layer_types=["full_attention"] * config.num_hidden_layers)
        pure = cache_bytes(full, args.context, dtype)
        result.update(pure_attention=pure, ratio=round(ours["total"] / pure["total"], 4))
    report(result, args.out)
    return result


if __name__ == "__main__":
    main()
