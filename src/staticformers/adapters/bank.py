"""Several adapters in one batch: stacked adapter weights and a per-row adapter index, shapes fixed.

Why this exists: a server holds one base model and many adapters, and one decode batch mixes rows of
different adapters (and rows of none). Merging gives one adapter per model copy; switching adapters
between steps serialises the requests. So each LoRA layer the bank covers holds its adapters stacked:

- `lora_bank_A` `[slots + 1, R, in]` and `lora_bank_B` `[slots + 1, out, R]` (buffers of the
  `LoraLinear`), B multiplied by its adapter's scaling, ranks below R zero-padded (which changes
  nothing), slot 0 all zeros: "no adapter";
- `rows`, one device tensor: each batch row's slot. Row i's LoRA term is
  `(x_i @ A[rows[i]]^T) @ B[rows[i]]^T`: a gather and two batched matmuls.

The shapes depend on (slots, R), fixed when the bank is made, and on the batch; so putting another
adapter of rank at most R into a slot writes the stacked tensors in place and compiles nothing, and
the rows index is written in place before each engine call: a graph input, and no graph depends on
its values. The layers read the bank only while the engine runs a step (`routed`, which sets
`engaged`); everything else (training, an eager forward, saving) uses the named adapters. A bank
made from the model's named adapters copies them, and copies them again when they changed
(`refresh`, before each prefill). One process only: a tensor-parallel model is refused.
"""

from __future__ import annotations

import weakref

import contextlib
import itertools
from typing import Iterable, Optional, Sequence

import torch

from ..models.quantization import compute_dtype
from .files import read_adapter
from .bank_registry import bank_of, drop_bank, set_bank
from . import fused_targets
from .lora import BASE, RESERVED, LoraLinear, linear_candidates, lora_modules, target_names, wrap
from .lora_config import LoraConfig

MAX_ROWS = 4096  # the largest batch the rows index holds
_serial = itertools.count(1)
_loads = itertools.count(1)  # each write of a slot: a number no other write in this process has


class AdapterBankError(ValueError):
    """A request for an adapter the bank does not hold, or an adapter that does not fit it."""


class AdapterBank:
    """Stacked adapters of a model's LoRA layers (see the module docstring). `slots`: name -> slot."""

    def __init__(self, model, layers: dict[str, LoraLinear], capacity: int, rank: int):
        self._model = weakref.ref(model)  # the registry is keyed by the model: no strong reference back
        self.layers = layers
        self.capacity, self.rank = int(capacity), int(rank)
        self.slots: dict[str, int] = {}
        self.sources: dict[str, str] = {}  # name -> the folder it was read from ("" for a named adapter)
        self._versions: dict[str, tuple] = {}
        self.loads: dict[int, int] = {}  # slot -> the load it holds (`load_of`)
        self.changes = 0  # slots written or cleared so far (a reader compares it to skip unchanged banks)
        self.engaged = False
        self.serial = next(_serial)  # part of the engine's fingerprint (adapters.adapter_state)
        weight = next(iter(layers.values())).base_layer.weight
        self.rows = torch.zeros(MAX_ROWS, dtype=torch.long, device=weight.device)
        for layer in layers.values():
            w = layer.base_layer.weight
            dtype = compute_dtype(layer.base_layer)  # a quantized base: its scales' dtype
            layer.register_buffer(
                "lora_bank_A",
                torch.zeros(capacity + 1, rank, layer.in_features, dtype=dtype, device=w.device),
                persistent=False,
            )
            layer.register_buffer(
                "lora_bank_B",
                torch.zeros(capacity + 1, layer.out_features, rank, dtype=dtype, device=w.device),
                persistent=False,
            )
            layer.lora_routing = self

    @property
    def model(self):
        model = self._model()
        if model is None:
            raise RuntimeError("The adapter bank's model no longer exists.")
        return model

    # ---- the forward -------------------------------------------------------------------------------
    def forward(self, layer: LoraLinear, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (the base projection of `x` `[b, s, in]`) plus each row's adapter term."""
        rows = self.rows[: x.shape[0]]
        a = layer.lora_bank_A.index_select(0, rows)  # [b, R, in]
        b = layer.lora_bank_B.index_select(0, rows)  # [b, out, R]
        h = torch.matmul(x.to(a.dtype), a.transpose(1, 2))
        return (out + torch.matmul(h, b.transpose(1, 2))).to(out.dtype)

    # ---- contents ----------------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return list(self.slots)

    def put(self, name: str, weights: dict, source: str = "") -> int:
        """Write adapter `name` (module -> (A `[r, in]`, B `[out, r]`, scaling)) into its slot (a free one for a
        new name), in place; returns the slot."""
        if name in RESERVED:
            raise AdapterBankError(f"The adapter name {name!r} is reserved: {RESERVED[name]}. Pick another name.")
        outside = [m for m in weights if m not in self.layers]
        if outside:
            raise AdapterBankError(
                f"Adapter {name!r} has weights on {outside[0]}, which this bank does not cover: make "
                f"the bank with target modules that include it."
            )
        ranks = {m: a.shape[0] for m, (a, _, _) in weights.items()}
        too_big = [m for m, r in ranks.items() if r > self.rank]
        if too_big:
            raise AdapterBankError(
                f"Adapter {name!r} has rank {ranks[too_big[0]]} on {too_big[0]}, more than the bank's "
                f"{self.rank}: make the bank with max_rank={ranks[too_big[0]]} or more."
            )
        slot = self.slots.get(name)
        if slot is None:
            free = [s for s in range(1, self.capacity + 1) if s not in self.slots.values()]
            if not free:
                raise AdapterBankError(
                    f"The adapter bank holds {self.capacity} adapter(s) ({', '.join(map(repr, self.slots))}) and "
                    f"is full: remove one first, or make it with a larger max_adapters."
                )
            slot = free[0]
        with torch.no_grad():
            for module, layer in self.layers.items():
                layer.lora_bank_A[slot].zero_()
                layer.lora_bank_B[slot].zero_()
                if module in weights:
                    a, b, scaling = weights[module]
                    r = a.shape[0]
                    layer.lora_bank_A[slot, :r].copy_(a)
                    layer.lora_bank_B[slot, :, :r].copy_(b.float() * scaling)
        self.slots[name], self.sources[name] = slot, source
        self.loads[slot] = next(_loads)
        self.changes += 1
        return slot

    def load_of(self, slot: int) -> int:
        """Which write of `slot` it holds now: a number given at each `put` and never given again, so
        anything computed with an adapter (the prefix cache's keys and values) can tell a reloaded adapter
        from the one it replaced though the name and the slot are the same; 0 for slot 0 (no adapter) and
        for a free slot."""
        return self.loads.get(int(slot), 0)

    def put_named(self, name: str) -> int:
        """Copy the model's named adapter `name` into the bank (again, when it is there already)."""
        weights = {
            m: (layer.lora_A[name].weight, layer.lora_B[name].weight, layer.scaling[name])
            for m, layer in self.layers.items()
            if name in layer.lora_A
        }
        if not weights:
            raise AdapterBankError(f"The model has no adapter named {name!r} on the layers this bank covers.")
        slot = self.put(name, weights)
        self._versions[name] = self._named_versions(name)
        return slot

    def load(self, name: str, path: str, **hub) -> int:
        """Read a PEFT adapter folder (checked, `adapter_files.read_adapter`) into a slot, in place: an adapter
        of rank at most the bank's on layers it covers compiles nothing."""
        if not isinstance(name, str) or not name or name == BASE:
            raise AdapterBankError(f"{name!r} is not an adapter name.")
        config, weights = read_adapter(self.model, path, **hub)
        return self.put(name, {m: (w["A"], w["B"], config.scaling_for(m)) for m, w in weights.items()}, source=path)

    def remove(self, name: str) -> None:
        slot = self.slots.pop(name)
        self.sources.pop(name, None)
        self._versions.pop(name, None)
        self.loads.pop(slot, None)
        self.changes += 1
        with torch.no_grad():
            for layer in self.layers.values():
                layer.lora_bank_A[slot].zero_()
                layer.lora_bank_B[slot].zero_()

    def _named_versions(self, name: str) -> tuple:
        return tuple(
            (id(p), p._version)
            for layer in self.layers.values()
            if name in layer.lora_A
            for p in (layer.lora_A[name].weight, layer.lora_B[name].weight)
        )

    def refresh(self) -> None:
        """Copy again the named adapters whose weights changed since they were copied (training, a hot swap)."""
        for name, versions in list(self._versions.items()):
            configs = getattr(self.model, "peft_config", None) or {}
            if name in configs and self._named_versions(name) != versions:
                self.put_named(name)

    # ---- routing -----------------------------------------------------------------------------------
    def slot_of(self, name: Optional[str]) -> int:
        """The slot a request's adapter uses: None is the model as it is (its one active adapter unless
        disabled, else none), "__base__" none; an unknown name is refused."""
        if name is None:
            active = [n for n in getattr(self.model, "active_adapter_names", None) or []]
            disabled = any(layer.disabled for layer in self.layers.values())
            return self.slots.get(active[0], 0) if len(active) == 1 and not disabled else 0
        if name == BASE:
            return 0
        if name not in self.slots:
            held = ", ".join(map(repr, self.slots)) or "none"
            raise AdapterBankError(f"There is no adapter named {name!r} here (the adapters are {held}): load it first.")
        return self.slots[name]

    def set_rows(self, rows: Optional[Sequence[int]], batch: int) -> None:
        """Write each row's slot (`rows`: the first rows, the rest get slot 0; None: every row the model's
        active adapter) into the rows index, in place."""
        if batch > MAX_ROWS:
            raise AdapterBankError(f"A batch of {batch} rows is more than an adapter bank routes ({MAX_ROWS}).")
        device = self.layers[next(iter(self.layers))].lora_bank_A.device
        if self.rows.device != device:  # the model moved
            self.rows = torch.zeros(MAX_ROWS, dtype=torch.long, device=device)
        values = [self.slot_of(None)] * batch if rows is None else list(rows) + [0] * (batch - len(rows))
        self.rows[:batch].copy_(torch.tensor(values, dtype=torch.long))

    def detach(self) -> None:
        """Take the bank off its layers (and the layers that hold no named adapter off the model)."""
        for layer in self.layers.values():
            layer._buffers.pop("lora_bank_A", None)
            layer._buffers.pop("lora_bank_B", None)
            layer.lora_routing = None
        model = self.model
        drop_bank(model)
        for name, layer in lora_modules(model).items():
            if not layer.lora_A:
                parent, _, leaf = name.rpartition(".")
                setattr(model.get_submodule(parent), leaf, layer.base_layer)
        self.layers = {}


def enable_adapter_batching(
    model,
    max_adapters: Optional[int] = None,
    max_rank: Optional[int] = None,
    target_modules: Optional[Iterable[str]] = None,
) -> AdapterBank:
    """Give the model an AdapterBank holding its named adapters, with room for `max_adapters` (default: as
    many as it has) of rank up to `max_rank` (default: the largest it has), on its LoRA layers plus
    `target_modules`. A bank the model had is replaced. Compiled generation steps are rebuilt once."""
    if getattr(model, "parallel_dims", None) is not None:
        raise AdapterBankError(
            "Batches mixing adapters need the model in one process: serve a tensor-parallel model "
            "with one adapter merged (merge_and_unload) instead."
        )
    old = bank_of(model)
    if old is not None:
        old.detach()
    configs = getattr(model, "peft_config", None) or {}
    layers = lora_modules(model)
    if target_modules:
        names = target_names(model, LoraConfig(target_modules=list(target_modules)))
        layers = {**layers, **wrap(model, names)}
        layers = {n: layers[n] for n in lora_modules(model)}  # the model's order
    if not layers:
        raise AdapterBankError(
            "The model has no adapter to batch: load adapters first (model.load_adapter(path, "
            "adapter_name=...)) or name the target modules."
        )
    ranks = [r for layer in layers.values() for r in layer.r.values()]
    rank = max_rank if max_rank is not None else max(ranks or [1])
    capacity = max_adapters if max_adapters is not None else max(len(configs), 1)
    for value, what in ((rank, "max_rank"), (capacity, "max_adapters")):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise AdapterBankError(f"{what}={value!r} must be a positive integer.")
    if len(configs) > capacity:
        raise AdapterBankError(f"The model has {len(configs)} adapters, more than max_adapters={capacity}.")
    bank = AdapterBank(model, layers, capacity, rank)
    set_bank(model, bank)
    for name in configs:
        bank.put_named(name)
    return bank


def bank_for_names(model, names: Iterable[str]) -> AdapterBank:
    """The model's bank, made (or made again, when it lacks room) so that it holds the named adapters
    `names` (PEFT's `adapter_names` of a mixed batch; "__base__" is no adapter)."""
    wanted = [n for n in dict.fromkeys(names) if n != BASE]
    configs = getattr(model, "peft_config", None) or {}
    unknown = [n for n in wanted if n not in configs]
    if unknown:
        held = ", ".join(map(repr, configs)) or "none"
        raise AdapterBankError(
            f"adapter_names asks for {unknown[0]!r}, which the model does not have (its adapters: "
            f"{held}; {BASE!r} is the base model)."
        )
    bank = bank_of(model)
    if bank is None:
        return enable_adapter_batching(model)
    missing = [n for n in wanted if n not in bank.slots]
    free = bank.capacity - len(bank.slots)
    if len(missing) > free or any(
        r > bank.rank for n in missing for layer in lora_modules(model).values() for a, r in layer.r.items() if a == n
    ):
        return enable_adapter_batching(model, max_adapters=max(bank.capacity, len(configs)))
    for n in missing:
        bank.put_named(n)
    return bank


def bank_for_files(
    model,
    adapters: dict[str, str],
    max_adapters: Optional[int] = None,
    max_rank: Optional[int] = None,
    target_modules=None,
    **hub,
) -> AdapterBank:
    """A bank holding the PEFT adapters `adapters` (name -> folder), all read and checked before the model
    is changed; it covers the union of their layers and of `target_modules` (a `LoraConfig.target_modules`
    value, e.g. "all-linear": room for adapters loaded later)."""
    read = {name: read_adapter(model, path, **hub) for name, path in adapters.items()}
    projections = linear_candidates(model)
    modules = sorted(
        {fused_targets.peft_name(model, m, projections) for _, weights in read.values() for m in weights}
        | set(target_names(model, LoraConfig(target_modules=target_modules)) if target_modules else ())
    )
    ranks = {name: max(a["A"].shape[0] for a in w.values()) for name, (_, w) in read.items() if w}
    largest = max(ranks.values(), default=1)
    if max_rank is not None and max_rank < largest:
        name = max(ranks, key=ranks.get)
        raise ValueError(
            f"--max-lora-rank {max_rank} is less than the rank {largest} of adapter {name!r} "
            f"({adapters[name]}): pass --max-lora-rank {largest} or more, or leave it out."
        )
    if max_adapters is not None and max_adapters < len(adapters):
        raise ValueError(
            f"--max-loras {max_adapters} is less than the {len(adapters)} adapters of --lora-modules: pass "
            f"--max-loras {len(adapters)} or more, or leave it out."
        )
    rank = max(max_rank or 1, largest)
    capacity = max(max_adapters or 0, len(adapters))
    bank = enable_adapter_batching(model, max_adapters=capacity, max_rank=rank, target_modules=modules)
    for name, (config, weights) in read.items():  # weights per model module; scales by PEFT's module names
        bank.put(
            name,
            {
                m: (w["A"], w["B"], config.scaling_for(fused_targets.peft_name(model, m, projections)))
                for m, w in weights.items()
            },
            source=adapters[name],
        )
    return bank


@contextlib.contextmanager
def routed(model, rows: Optional[Sequence[int]], batch: int, refresh: bool = False):
    """While an engine step runs: the bank's rows set (see `AdapterBank.set_rows`) and its layers reading
    it; `refresh`: named adapters copied again first if they changed. Nothing to do for a model without
    a bank (then `rows` must name no adapter)."""
    bank = bank_of(model)
    if bank is None:
        if rows is not None and any(rows):
            raise AdapterBankError(
                "Rows ask for adapters but the model has no adapter bank: model.enable_adapter_batching() first."
            )
        yield
        return
    if refresh:
        bank.refresh()
    bank.set_rows(rows, batch)
    bank.engaged = True
    try:
        yield
    finally:
        bank.engaged = False


__all__ = [
    "AdapterBank",
    "AdapterBankError",
    "enable_adapter_batching",
    "bank_for_files",
    "bank_for_names",
    "bank_of",
    "routed",
    "MAX_ROWS",
]
