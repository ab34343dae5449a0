"""The static KV cache: preallocated once per (batch bucket, KV length), updated in place, reused.

The decoder (`modeling.py`) asks any `kv_cache` object for `max_length` and calls
`update(layer_idx, k, v, cache_position)`; this module provides two such objects:

- `StaticKVCache`: per layer a key and a value buffer `[batch, kv_heads, max_length, head_dim]` in the
  model's dtype on the model's device. `update` writes the new keys/values at `cache_position` with
  `index_copy_` (an in-place scatter that compilers keep in place) and returns the whole buffers.
  Decode graphs take it; its shapes never change, so neither do theirs. `layer_views()` gives one
  `LayerKV` per layer (that layer's two buffers), which a compiled single-layer region takes, so that
  one graph serves every layer (`steps.py`).
- `PrefillKV`: a cache over the prompt alone (`max_length` = the prompt bucket). It keeps what each
  layer produced so that the engine can copy it into a `StaticKVCache` of any length after the
  prefill graph ran. Prefill graphs therefore depend on `[batch, prompt]` only, not on the KV length:
  fewer graphs to compile. `LayerSink` is the same for one layer (the single-layer prefill region).

Stale slots need no clearing: the engine's attention mask over the cache hides every slot a call has
not written.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..memory_check import check_fits


class StaticKVCache:
    """Preallocated key/value buffers for every layer (see the module docstring)."""

    def __init__(self, num_layers: int, batch: int, kv_heads: int, max_length: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.batch, self.max_length = int(batch), int(max_length)
        shape = (self.batch, kv_heads, self.max_length, head_dim)
        check_fits(2 * num_layers * math.prod(shape) * dtype.itemsize, device,
                   f"The KV cache ({self.batch} sequences x {self.max_length} positions)", "lower max_model_len or the batch buckets")
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.formulate(None, None, None)

    def formulate(self, attention: Optional[str], linears: Optional[str], head_linear: Optional[str]) -> None:
        """How a decode over this cache computes (read by `modeling.py`; see `engine.decode_formulation`)."""
        self.decode_attention, self.linears, self.head_linear = attention, linears, head_linear
        self._views = [LayerKV(self, i) for i in range(len(self.keys))]

    def layer_views(self) -> list["LayerKV"]:
        return self._views

    @classmethod
    def for_model(cls, model, batch: int, max_length: int) -> "StaticKVCache":
        c = model.config
        # a tensor-parallel rank computes num_key_value_heads / tp heads (staticformers.distributed)
        dims = getattr(model, "parallel_dims", None)
        kv_heads = c.num_key_value_heads // (dims.tp if dims is not None else 1)
        return cls(c.num_hidden_layers, batch, kv_heads, max_length, c.head_dim, model.dtype, model.device)

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, cache_position: torch.Tensor):
        key, value = self.keys[layer_idx], self.values[layer_idx]
        key.index_copy_(2, cache_position, k)
        value.index_copy_(2, cache_position, v)
        return key, value

    def load_prefill(self, prefill: "PrefillKV") -> None:
        """Copy what a prefill produced (every layer's keys and values) into slots [0, prompt_len)."""
        for i, (k, v) in enumerate(zip(prefill.keys, prefill.values)):
            self.load_layer(i, k, v)

    def load_layer(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Copy one layer's prompt keys and values (`[batch, kv_heads, prompt_len, head_dim]`) into slots
        [0, prompt_len)."""
        length = k.shape[2]
        self.keys[layer_idx][:, :, :length].copy_(k)
        self.values[layer_idx][:, :, :length].copy_(v)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


class LayerKV:
    """One layer's slice of a `StaticKVCache` (its key and value buffers and the cache's formulation):
    `update` ignores the layer index, so a region compiled for one layer runs every layer."""

    def __init__(self, cache: StaticKVCache, layer_idx: int):
        self.key, self.value = cache.keys[layer_idx], cache.values[layer_idx]
        self.max_length = cache.max_length
        self.decode_attention, self.linears = cache.decode_attention, cache.linears

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, cache_position: torch.Tensor):
        self.key.index_copy_(2, cache_position, k)
        self.value.index_copy_(2, cache_position, v)
        return self.key, self.value


class LayerSink:
    """One layer's prefill keys and values, kept as they are produced (the prompt-only cache of one
    layer); `decode_attention` and `linears` are the prefill formulation (`engine.prefill_formulation`)."""

    def __init__(self, max_length: int, decode_attention: Optional[str] = None, linears: Optional[str] = None):
        self.max_length = int(max_length)
        self.decode_attention, self.linears = decode_attention, linears
        self.key = self.value = None

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, cache_position: torch.Tensor):
        self.key, self.value = k, v
        return k, v


class PrefillKV:
    """A cache over the prompt only: `update` keeps k/v and returns them (see the module docstring)."""

    def __init__(self, num_layers: int, max_length: int):
        self.max_length = int(max_length)
        self.keys: list = [None] * num_layers
        self.values: list = [None] * num_layers

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, cache_position: torch.Tensor):
        self.keys[layer_idx], self.values[layer_idx] = k, v
        return k, v
