"""The static KV cache: one row per slot, each row at its own positions.

`KVCache` holds, per layer, keys and values `[slots, kv_heads, length, head_dim]`, allocated once per
(batch bucket, KV length) and updated in place. Row `i` is slot `i`: a sequence's prompt occupies
positions `0..n-1` of its row and each decode step writes the next position of every row, so a
row's cache index *is* its token's position and the attention mask follows from each row's position
alone (`models/decoder.py`, `build_masks`). No host mask crosses to the device, and positions a row has not
written (padding of a prefill bucket, what an earlier sequence left in a reused slot) are hidden by
that mask until the row writes them.

- `update(layer, k, v, position_ids)` (what the model calls) writes each row's keys and values at its
  own positions (`position_ids` `[slots, s]`) with one scatter per tensor.
- `insert(slots, layer, k, v)` puts a prefill's keys and values (`[n, kv_heads, L, head_dim]`) into
  positions `0..L-1` of the rows `slots`, leaving the other rows as they are: a request joins a running
  batch between two decode steps (`generation/loop.py`).
- `copy_rows(source, src, dst)` moves rows from another cache (a batch moving to a larger batch bucket
  or KV length, `generation/loop.py`).

A hybrid model's linear-attention layers (Qwen3.5's Gated DeltaNet, `linear_attention.py`) keep a fixed-size
state per row instead of positions: in their slots of `keys` and `values`, the convolution's state `[slots,
channels, kernel - 1]` (the model's dtype) and the recurrent state `[slots, heads, key dim, value dim]`
(float32), whatever the cache's length. `state(layer)` reads them, `update` writes them whole, `insert` and
`copy_rows` move whole rows. `linear_states(config)` says which layers and what shapes.

A latent-attention model (DeepSeek's MLA, `latent_attention.py`) caches one latent per position instead:
`layout(config)` gives it one "head" of `kv_lora_rank + qk_rope_head_dim` keys and no value buffers, its
values being the keys' first `kv_lora_rank` columns (`latent`: `update` writes the keys alone and returns
that view). Its bytes per position are the latent's, whatever the head count.

A hybrid cache also says which tokens of a step its linear-attention layers count, per row (`count`, read by the
decoder as `last_index`), and, with `rollback` > 0, keeps their states after each position of a step up to that
many tokens wide, so that a speculative verification keeps only what each row accepted (`roll_back`;
`state_rollback.py`).

`PrefillKV` is the cache a prefill runs with: it keeps the keys and values it is given and returns them
unchanged, so a prefill graph depends on `[batch, prompt]` only, not on the KV length, and its keys
and values are inserted afterwards. `LayerKV` is one layer's view of a `KVCache`, whose `update`
ignores the layer index: a region compiled for one layer runs every layer. A `PrefillKV` made for no
layers is the same for a prompt: it keeps the latest layer's keys and values, never reading the index.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .config_linear import state_shapes
from .state_rollback import RollbackStates, record_states


def layout(config, tp: int = 1) -> tuple[int, int, Optional[int]]:
    """(heads, dims per head, latent) of one layer's cache: `num_key_value_heads / tp` heads of `head_dim` keys
    and as many values; for latent attention one head of `kv_lora_rank + qk_rope_head_dim` keys whose first
    `latent = kv_lora_rank` columns are the values (None otherwise)."""
    if config.latent_attention:
        return 1, config.kv_lora_rank + config.qk_rope_head_dim, config.kv_lora_rank
    return config.num_key_value_heads // tp, config.head_dim, None


def linear_states(config, tp: int = 1) -> dict[int, tuple[tuple, tuple]]:
    """{layer: (conv state shape, recurrent state shape)} of one row, for each linear-attention layer; `tp`: the
    tensor-parallel degree (a rank keeps the states of its own `1 / tp` of the heads)."""
    if not config.has_linear_attention:
        return {}
    shapes = state_shapes(config, tp)
    return {i: shapes for i in range(config.num_hidden_layers) if config.layer_is_linear(i)}


def bytes_per_position(config, dtype: torch.dtype, tp: int = 1) -> int:
    """What one position of one row costs over the layers that keep positions, keys and values, in bytes."""
    heads, dim, latent = layout(config, tp)
    layers = config.num_hidden_layers - len(linear_states(config))
    return layers * heads * dim * (1 if latent else 2) * dtype.itemsize


def state_bytes_per_row(config, dtype: torch.dtype) -> int:
    """What one row's fixed-size states cost over the linear-attention layers, in bytes (its length does not count)."""
    return sum(
        math.prod(conv) * dtype.itemsize + math.prod(recurrent) * 4  # the recurrent state is float32
        for conv, recurrent in linear_states(config).values()
    )


class KVCache:
    """Preallocated key/value buffers for every layer (see the module docstring); `latent`: the values are the
    keys' first `latent` columns, and no value buffer is allocated (latent attention)."""

    last_index = None  # a running cache counts every position it is given (`PrefillKV.last_index`)

    def __init__(
        self,
        num_layers: int,
        batch: int,
        kv_heads: int,
        max_length: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        latent: Optional[int] = None,
        linear: Optional[dict] = None,
        rollback: int = 0,
    ):
        self.batch, self.max_length, self.latent = int(batch), int(max_length), latent
        self.linear = dict(linear or {})  # {layer: (conv state shape, recurrent state shape)}
        self.rollback = RollbackStates(self.batch, self.linear, rollback, dtype, device) if self.linear else None
        if self.rollback is not None:
            self.last_index = self.rollback.last_index  # [slots]: each row's last counted token of a step
        shape = (self.batch, kv_heads, self.max_length, head_dim)

        def keys(i):
            return torch.zeros(
                (self.batch, *self.linear[i][0]) if i in self.linear else shape, dtype=dtype, device=device
            )

        def values(i):
            if i in self.linear:
                return torch.zeros((self.batch, *self.linear[i][1]), dtype=torch.float32, device=device)
            return torch.zeros(shape, dtype=dtype, device=device)

        self.keys = [keys(i) for i in range(num_layers)]
        self.values = [] if latent else [values(i) for i in range(num_layers)]
        self._views = [LayerKV(self, i) for i in range(num_layers)]

    @classmethod
    def for_model(cls, model, batch: int, max_length: int, tp: int = 1, rollback: int = 0) -> "KVCache":
        """The cache of `model` for `batch` rows of `max_length` positions; `tp`: the tensor-parallel degree
        the model is partitioned with (a rank computes `num_key_value_heads / tp` heads, and a linear-attention
        layer's states of `1 / tp` of its heads); `rollback`: the widest step whose linear-attention states are kept
        per position (a hybrid model's speculative verification)."""
        c = model.config
        heads, dim, latent = layout(c, tp)
        return cls(
            c.num_hidden_layers,
            batch,
            heads,
            max_length,
            dim,
            model.dtype,
            model.device,
            latent,
            linear_states(c, tp),
            rollback,
        )

    @staticmethod
    def bytes_for(model, batch: int, max_length: int, tp: int = 1, rollback: int = 0) -> int:
        """What `for_model` allocates, in bytes (checked against the device's memory before allocating)."""
        c = model.config
        states = state_bytes_per_row(c, model.dtype) // tp  # every state splits over the heads, which tp divides
        return batch * (
            max_length * bytes_per_position(c, model.dtype, tp)
            + states
            + RollbackStates.bytes_for(linear_states(c, tp), rollback, model.dtype)
        )

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Every buffer the model reads or writes: the keys, then the values (none for a latent cache), then a
        hybrid cache's counted positions and per-position states."""
        return self.keys + self.values + (self.rollback.tensors if self.rollback is not None else [])

    @property
    def position_tensors(self) -> list[torch.Tensor]:
        """The keys, then the values: what a prefix of positions is made of."""
        return self.keys + self.values

    @property
    def shape(self) -> tuple[int, int]:
        return self.batch, self.max_length

    def mark_static(self) -> None:
        """Tell the compiler the buffers never move (what CUDA graphs need of an input written in place)."""
        for t in self.tensors:
            torch._dynamo.mark_static_address(t)

    def layer_views(self) -> list["LayerKV"]:
        return self._views

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, position_ids: torch.Tensor):
        if layer_idx in self.linear:
            return write_states(self.keys[layer_idx], self.values[layer_idx], k, v)
        if self.latent:
            return write_latent(self.keys[layer_idx], k, position_ids, self.latent)
        return write_rows(self.keys[layer_idx], self.values[layer_idx], k, v, position_ids)

    def state(self, layer_idx: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """A linear-attention layer's (conv state, recurrent state) of every row; None for another layer."""
        return (self.keys[layer_idx], self.values[layer_idx]) if layer_idx in self.linear else None

    @property
    def rollback_width(self) -> int:
        """The widest step whose linear-attention states are kept per position (0: none)."""
        return self.rollback.width if self.rollback is not None else 0

    def record(self, layer_idx: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """A linear-attention layer's states after each token of a step (`state_rollback.py`)."""
        self.rollback.record(layer_idx, conv, recurrent)

    def count(self, last: dict) -> None:
        """Which tokens of the next step the linear-attention layers count: `last` {row: index of its last counted
        token}; the other rows count none, their states staying as they are. Nothing for a cache without them."""
        if self.rollback is not None:
            self.rollback.count([last.get(row, -1) for row in range(self.batch)])

    def roll_back(self, index: torch.Tensor) -> None:
        """Each row's linear-attention states after its `index`-th token of the last step (-1: as the step left
        them)."""
        self.rollback.roll_back({i: (self.keys[i], self.values[i]) for i in self.linear}, index)

    def insert(self, slots: torch.Tensor, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write a prefill's keys and values (`[n, kv_heads, L, head_dim]`) into positions `0..L-1` of the
        rows `slots` (`[n]`, on the cache's device); positions past the cache's length are dropped (they
        are padding of the prompt bucket: a row's prompt always fits). A latent cache takes the keys alone;
        a linear-attention layer takes the rows' states whole."""
        if layer_idx in self.linear:
            self.keys[layer_idx].index_copy_(0, slots, k.to(self.keys[layer_idx].dtype))
            self.values[layer_idx].index_copy_(0, slots, v.float())
            return
        length = min(k.shape[2], self.max_length)
        self.keys[layer_idx][:, :, :length].index_copy_(0, slots, k[:, :, :length])
        if not self.latent:
            self.values[layer_idx][:, :, :length].index_copy_(0, slots, v[:, :, :length])

    def copy_rows(self, source: "KVCache", src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy rows `src` of `source` into rows `dst` of this cache (as many positions as both hold; a
        linear-attention layer's states whole)."""
        length = min(source.max_length, self.max_length)
        for i, (mine, theirs) in enumerate(zip(self.keys, source.keys)):
            if i in self.linear:
                mine.index_copy_(0, dst, theirs.index_select(0, src))
                self.values[i].index_copy_(0, dst, source.values[i].index_select(0, src))
                continue
            mine[:, :, :length].index_copy_(0, dst, theirs[:, :, :length].index_select(0, src))
            if not self.latent:
                m, t = self.values[i], source.values[i]
                m[:, :, :length].index_copy_(0, dst, t[:, :, :length].index_select(0, src))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


def write_rows(
    key: torch.Tensor, value: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write `k`/`v` (`[b, kv_heads, s, head_dim]`) into `key`/`value` at each row's positions
    (`position_ids` `[b, s]`) in place; returns the buffers.

    An indexed assignment (`index_put_`), which compilers turn into an in-place indirect store; a
    `scatter_` there was lowered by inductor as a copy of the whole buffer around the scatter."""
    rows = torch.arange(k.shape[0], device=key.device).view(-1, 1)
    key[rows, :, position_ids] = k.transpose(1, 2)
    value[rows, :, position_ids] = v.transpose(1, 2)
    return key, value


def write_states(
    conv: torch.Tensor, recurrent: torch.Tensor, new_conv: torch.Tensor, new_recurrent: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear-attention layer's states of every row, replaced in place; returns the buffers."""
    conv.copy_(new_conv)
    recurrent.copy_(new_recurrent)
    return conv, recurrent


def write_latent(
    key: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor, latent: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`write_rows` for a latent cache: the keys alone; returns the buffer and its first `latent` columns
    (the values)."""
    rows = torch.arange(k.shape[0], device=key.device).view(-1, 1)
    key[rows, :, position_ids] = k.transpose(1, 2)
    return key, key[..., :latent]


class LayerKV:
    """One layer's slice of a `KVCache`: `update` ignores the layer index, so a region compiled for one
    layer runs every layer."""

    last_index = None  # as `KVCache`'s

    def __init__(self, cache: KVCache, layer_idx: int):
        self.key = cache.keys[layer_idx]
        self.value = None if cache.latent else cache.values[layer_idx]
        self.latent = cache.latent
        self.linear = layer_idx in cache.linear
        self.max_length = cache.max_length
        self.last_index = cache.last_index
        self.rollback_width = cache.rollback_width if self.linear else 0
        if self.rollback_width:  # this layer's per-position states (no lookup by layer: one region runs every layer)
            self.conv_each = cache.rollback.conv[layer_idx]
            self.recurrent_each = cache.rollback.recurrent[layer_idx]

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, position_ids: torch.Tensor):
        if self.linear:
            return write_states(self.key, self.value, k, v)
        if self.latent:
            return write_latent(self.key, k, position_ids, self.latent)
        return write_rows(self.key, self.value, k, v, position_ids)

    def state(self, layer_idx: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        return (self.key, self.value) if self.linear else None

    def record(self, layer_idx: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        record_states(self.conv_each, self.recurrent_each, conv, recurrent)


class PrefillKV:
    """A cache over the prompt only: `update` keeps k/v and returns them (see the module docstring).
    `keys`, `values`: each of `num_layers` layers'; made for none (what a layer region, run for every
    layer, takes), `key`, `value`: the latest layer's."""

    def __init__(self, max_length: int, num_layers: int = 0, last_index: Optional[torch.Tensor] = None):
        self.max_length = int(max_length)
        self.last_index = last_index  # [b]: each row's last prompt token (what linear-attention layers count)
        self.keys: list = [None] * num_layers
        self.values: list = [None] * num_layers
        self.key = self.value = None

    rollback_width = 0  # a prompt keeps no state per position

    def state(self, layer_idx: int) -> None:
        """No state before the prompt: a linear-attention layer starts from zeros."""
        return None

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, position_ids: Optional[torch.Tensor]):
        if self.keys:
            self.keys[layer_idx], self.values[layer_idx] = k, v
        else:
            self.key, self.value = k, v
        return k, v
