"""The block KV cache: one pool of fixed-size blocks per layer, each row reading its own blocks through a table.

Why this exists: a static cache (`kv_cache.py`) gives every row `[K]` positions of every layer from the moment
its request joins, K the largest need of the batch, so memory goes to positions that no request has written
yet, and most requests are short. Here a request holds only the blocks that its tokens fill, and the pool's
size is a memory budget, not batch x length.

- `KVBlocks` is the pool: per layer, keys (and values) `[blocks + 1, block_size, kv_heads, head_dim]`. Block 0
  is the *null block*: every table entry that no block backs points at it. What lands there (the writes of
  free rows, of padding positions past a row's blocks) is never read unmasked, since a row attends only to
  positions up to its own, which its blocks back.
- `BlockKVCache` is a `[batch, K]` view of the pool for one step shape, what the steps take where they took a
  `KVCache`: its `table` `[batch, K / block_size]` (int64, on the device) maps each row's logical block to a
  pool block. The generation loop owns which blocks a row holds (`generation/kv_blocks.py`) and writes the
  table between steps (`write_table`): data, not a graph, so the plan's shapes are those of the static cache.
- `update(layer, k, v, position_ids)` writes each row's keys and values into the block and offset of each of
  its positions (one indexed store per tensor), then gathers the row's blocks up to K: `[batch, kv_heads, K,
  head_dim]`, logical position j at index j, so the masks are the static cache's (`decoder.py`'s
  `build_masks`). This is the gather, attend, scatter of NxD Inference: fixed shapes on every device; the gather
  reads the row's context once more than a static cache would.
- `insert` puts a prefill's keys and values into positions `0..L-1` of rows (through the table), and
  `copy_rows` copies table rows from another view of the same pool: a batch moving to another shape copies no
  keys or values.

**Two groups of layers** (a model that mixes sliding-window and full-attention layers: Gemma 2 and 3, gpt-oss, Qwen2's
`max_window_layers`): the window layers' pools may hold fewer blocks (`window_blocks`), and each view then has a
second table, `window_table`, through which they read and write. A row's window blocks are handed out and given back
apart from its full layers' (`generation/scheduler.py` gives back those behind the window), so the full layers keep a
row's whole context while the window layers hold only its last window. Both tables have one entry per logical
block, `[batch, K / block_size]`, so the plan's shapes are the same as with one.

A latent-attention model (DeepSeek's MLA) keeps one latent per position: keys only, whose first `latent` columns
are the values, as in `kv_cache.py`. Linear-attention layers keep states per row, not per position: a hybrid
model runs on static caches (the loop refuses blocks for it).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .kv_cache import bytes_per_position, layout

NULL_BLOCK = 0  # the pool block behind every table entry that no block backs

WindowGroup = tuple  # (the window layers' indices, how many blocks their pools hold)


class KVBlocks:
    """The pool (see the module docstring): `blocks` usable blocks of `block_size` positions, block 0 besides; the
    layers in `window_layers` (a group of their own, read through a second table) `window_blocks` of them."""

    def __init__(
        self,
        num_layers: int,
        blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        latent: Optional[int] = None,
        window: Optional[WindowGroup] = None,
    ):
        self.blocks, self.block_size, self.latent = int(blocks), int(block_size), latent
        self.window_layers = frozenset(window[0]) if window is not None else frozenset()
        self.window_blocks = int(window[1]) if window is not None else None

        def pool(layer: int) -> torch.Tensor:
            count = self.window_blocks if layer in self.window_layers else self.blocks
            return torch.zeros((count + 1, self.block_size, kv_heads, head_dim), dtype=dtype, device=device)

        self.keys = [pool(i) for i in range(num_layers)]
        self.values = [] if latent else [pool(i) for i in range(num_layers)]

    @classmethod
    def for_model(
        cls, model, blocks: int, block_size: int, tp: int = 1, window: Optional[WindowGroup] = None
    ) -> "KVBlocks":
        """The pool of `model` (`tp`: its tensor-parallel degree; a rank holds its share of the KV heads); `window`:
        (the window layers, their blocks), a group of their own."""
        c = model.config
        heads, dim, latent = layout(c, tp)
        return cls(c.num_hidden_layers, blocks, block_size, heads, dim, model.dtype, model.device, latent, window)

    @staticmethod
    def bytes_for(model, blocks: int, block_size: int, tp: int = 1, window: Optional[WindowGroup] = None) -> int:
        """What `for_model` allocates, in bytes (the null blocks included)."""
        if window is None:
            return (int(blocks) + 1) * int(block_size) * bytes_per_position(model.config, model.dtype, tp)
        heads, dim, latent = layout(model.config, tp)
        per_layer = int(block_size) * heads * dim * (1 if latent else 2) * model.dtype.itemsize
        windowed = len(window[0])
        full = model.config.num_hidden_layers - windowed
        return ((int(blocks) + 1) * full + (int(window[1]) + 1) * windowed) * per_layer

    @staticmethod
    def blocks_in(
        model,
        budget: int,
        block_size: int,
        tp: int = 1,
        window: Optional[Callable[[int], Optional[WindowGroup]]] = None,
    ) -> int:
        """How many usable blocks a budget of `budget` bytes holds (the null blocks counted against it). `window(n)`:
        the window group beside a pool of n blocks (None: none), whose smaller pools leave more of the budget to the
        full layers."""
        per_block = int(block_size) * bytes_per_position(model.config, model.dtype, tp)
        count = max(int(budget) // per_block - 1, 0)
        if window is None or window(count) is None:
            return count
        low, high = count, (count + 1) * model.config.num_hidden_layers  # the most blocks: a window pool of none
        while low < high:  # the largest count whose pools fit the budget (their bytes grow with it)
            mid = (low + high + 1) // 2
            if KVBlocks.bytes_for(model, mid, block_size, tp, window(mid)) <= budget:
                low = mid
            else:
                high = mid - 1
        return low

    @property
    def tensors(self) -> list[torch.Tensor]:
        return self.keys + self.values

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


class BlockKVCache:
    """A `[batch, max_length]` view of a `KVBlocks` pool through a block table (see the module docstring)."""

    last_index = None  # a block cache counts every position it is given (no linear-attention layers)
    linear: dict = {}
    rollback = None
    rollback_width = 0

    def __init__(self, pool: KVBlocks, batch: int, max_length: int):
        if max_length % pool.block_size:
            raise ValueError(
                f"A KV length of {max_length} is not a whole number of {pool.block_size}-position "
                f"blocks: make the plan's KV lengths multiples of the block size."
            )
        self.pool, self.batch, self.max_length = pool, int(batch), int(max_length)
        self.block_size, self.latent = pool.block_size, pool.latent
        device = pool.keys[0].device

        def table() -> torch.Tensor:
            return torch.full(
                (self.batch, self.max_length // self.block_size), NULL_BLOCK, dtype=torch.long, device=device
            )

        self.table = table()
        self.window_table = table() if pool.window_layers else None  # the window layers' (None: one group)
        self._views = [BlockLayerKV(self, i) for i in range(len(pool.keys))]

    @property
    def shape(self) -> tuple[int, int]:
        return self.batch, self.max_length

    @property
    def width(self) -> int:
        """Blocks per row of the table."""
        return self.table.shape[1]

    @property
    def tables(self) -> list[torch.Tensor]:
        """The table, then the window layers' where they are a group of their own."""
        return [self.table] + ([self.window_table] if self.window_table is not None else [])

    def table_of(self, layer_idx: int) -> torch.Tensor:
        """The table through which layer `layer_idx` reads and writes the pool."""
        if self.window_table is not None and layer_idx in self.pool.window_layers:
            return self.window_table
        return self.table

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Every buffer a step reads or writes: the pool's keys and values, then the tables."""
        return self.pool.tensors + self.tables

    @property
    def nbytes(self) -> int:
        """The tables' bytes (the pool is shared by every view: `KVBlocks.nbytes`)."""
        return sum(t.numel() * t.element_size() for t in self.tables)

    def mark_static(self) -> None:
        for t in self.tensors:
            torch._dynamo.mark_static_address(t)

    def layer_views(self) -> list["BlockLayerKV"]:
        return self._views

    def write_table(self, rows: dict, window_rows: Optional[dict] = None) -> None:
        """Set the whole table: `rows` {row: [pool block of each logical block]}; every other entry the null block.
        With two groups, `window_rows` is the window layers' table the same way. One host-to-device copy each."""
        if (window_rows is None) != (self.window_table is None):
            raise ValueError("A block cache with a window group takes both tables' rows, one with none takes one.")
        for table, entries in ((self.table, rows), (self.window_table, window_rows)):
            if table is None or entries is None:
                continue
            host = torch.full((self.batch, self.width), NULL_BLOCK, dtype=torch.long)
            for row, blocks in entries.items():
                blocks = list(blocks)[: self.width]
                if blocks:
                    host[row, : len(blocks)] = torch.as_tensor(blocks, dtype=torch.long)
            table.copy_(host.to(table.device))

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, position_ids: torch.Tensor):
        values = None if self.latent else self.pool.values[layer_idx]
        table = self.table_of(layer_idx)
        return write_and_gather(self.pool.keys[layer_idx], values, table, k, v, position_ids, self.latent)

    def state(self, layer_idx: int) -> None:
        return None

    def count(self, last: dict) -> None:
        """Nothing to count: no linear-attention layers."""

    def insert(self, slots: torch.Tensor, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """A prefill's keys and values (`[n, kv_heads, L, head_dim]`) into positions `0..L-1` of the rows `slots`,
        through their table rows; positions past K are dropped, those past a row's blocks land in the null block."""
        length = min(k.shape[2], self.max_length)
        positions = torch.arange(length, device=self.table.device)
        blocks = self.table_of(layer_idx).index_select(0, slots)[:, positions // self.block_size]  # [n, length]
        offsets = positions % self.block_size
        self.pool.keys[layer_idx][blocks, offsets] = k[:, :, :length].transpose(1, 2)
        if not self.latent:
            self.pool.values[layer_idx][blocks, offsets] = v[:, :, :length].transpose(1, 2)

    def copy_rows(self, source: "BlockKVCache", src: torch.Tensor, dst: torch.Tensor) -> None:
        """Rows `src` of `source` (a view of the same pool) as rows `dst` of this one: their table rows, as many
        blocks as both hold."""
        if source.pool is not self.pool:
            raise ValueError("Block caches copy rows only between views of one pool.")
        width = min(source.width, self.width)
        for mine, theirs in zip(self.tables, source.tables):
            mine[:, :width].index_copy_(0, dst, theirs[:, :width].index_select(0, src))


def write_and_gather(
    key: torch.Tensor,
    value: Optional[torch.Tensor],
    table: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    position_ids: torch.Tensor,
    latent: Optional[int] = None,
):
    """Write `k`/`v` (`[b, kv_heads, s, head_dim]`) at each row's positions (`position_ids` `[b, s]`) into the pool
    blocks `table` maps them to, then gather every row's blocks: keys and values `[b, kv_heads, K, head_dim]`
    (a latent cache: the keys and their first `latent` columns)."""
    size = key.shape[1]
    rows = torch.arange(k.shape[0], device=key.device).view(-1, 1)
    blocks, offsets = table[rows, position_ids // size], position_ids % size
    key[blocks, offsets] = k.transpose(1, 2)
    if value is not None:
        value[blocks, offsets] = v.transpose(1, 2)
    b, width = table.shape

    def gathered(pool):  # [b, width, size, heads, dim] -> [b, heads, width * size, dim]
        return pool[table].view(b, width * size, *pool.shape[2:]).transpose(1, 2)

    keys = gathered(key)
    if latent:
        return keys, keys[..., :latent]
    return keys, gathered(value)


class BlockLayerKV:
    """One layer's slice of a `BlockKVCache`: `update` ignores the layer index, so a region compiled for one layer
    runs every layer (as `kv_cache.LayerKV`)."""

    last_index = None
    linear = False
    rollback_width = 0

    def __init__(self, cache: BlockKVCache, layer_idx: int):
        self.key = cache.pool.keys[layer_idx]
        self.value = None if cache.latent else cache.pool.values[layer_idx]
        self.table, self.latent, self.max_length = cache.table_of(layer_idx), cache.latent, cache.max_length

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, position_ids: torch.Tensor):
        return write_and_gather(self.key, self.value, self.table, k, v, position_ids, self.latent)

    def state(self, layer_idx: int) -> None:
        return None


__all__ = ["KVBlocks", "BlockKVCache", "BlockLayerKV", "NULL_BLOCK", "WindowGroup", "write_and_gather"]
