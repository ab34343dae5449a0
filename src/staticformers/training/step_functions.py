"""The compiled training and evaluation functions, and the count of graphs they build.

`forward_loss(model, batch...)` runs the model with labels and returns the loss. With
`torch_compile=True` it is compiled with the device's backend (`fullgraph=True, dynamic=False`)
as regions (`compilation/regions.py`): one decoder layer, whose graph every layer of the model reuses
(their parameters are graph inputs, not constants; one layer region per distinct layer kind: attention
window, dense or sparse MLP), and the head (final norm, lm_head and loss). A mixture of experts trained
with `output_router_logits` runs routed layer regions, which also return the router logits, and the head
adds the load-balancing loss: the same regions, one graph each. Embedding, masks and rotary tables (a
handful of small ops) and the optimizer step stay eager. Compiling one layer instead of all of them is
what keeps the first step short: the compiler's work no longer grows with depth, while each step still
runs the same fused kernels. Models without our decoder layout (`regions.has_decoder_layout`) are
compiled whole, as one graph.

Every region goes through the one compile path (`compilation.compiler.compile_function`): counted, one
graph per function (a second one is a violation of the fixed shapes, raised in strict mode). The model
object is never wrapped, so its state dict keeps its names and the caller's model is the one that
trains. Every batch has the same shapes and dtypes and the token count (`num_items_in_batch`) is a 0-d
tensor, not a Python number, so nothing is specialised on values. `ops` is the device backend's
formulation for training (`backends.Backend.training_ops`).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..compilation.compiler import CompiledFunction, compile_function, enable_persistent_cache
from ..compilation.regions import (
    has_decoder_layout,
    layer_region,
    loss_head_region,
    region_name,
    regional_loss,
    routed_layer_region,
    routes_logits,
)
from ..models.ops import PLAIN, Ops


def forward_loss(model, input_ids, labels, position_ids, num_items_in_batch, ops=PLAIN):
    """Loss of one batch: summed token losses divided by `num_items_in_batch` (a 0-d tensor)."""
    kwargs = {"ops": ops} if has_decoder_layout(model) else {}
    return model(
        input_ids=input_ids, labels=labels, position_ids=position_ids, num_items_in_batch=num_items_in_batch, **kwargs
    ).loss


class StepFunction:
    """`forward_loss` compiled (or not) for one role ("train" or "eval"), with its graph count.

    `regional=True` (the default when compiling) compiles the layer regions (one per distinct window)
    and the head region; `False` compiles the whole forward and loss as one graph (used for models
    without our decoder layout). Functions are made on first use, once the model is known."""

    def __init__(self, role: str, compile: bool, backend: Optional[str], regional: bool = True, ops: Ops = PLAIN):
        self.role, self.compile, self.backend, self.ops = role, compile, backend, ops
        self.regional = compile and regional
        self.functions: dict = {}  # what -> CompiledFunction

    def _function(self, key, fn: Callable, name: str, shape: tuple) -> CompiledFunction:
        f = self.functions.get(key)
        if f is None:
            if self.backend not in ("eager", "aot_eager"):
                enable_persistent_cache()  # a second process compiles nothing it compiled before
            f = self.functions[key] = compile_function(fn, name, shape, self.backend)
        return f

    @property
    def graphs(self) -> int:
        return sum(f.graphs for f in self.functions.values())

    @property
    def compile_seconds(self) -> float:
        return sum(f.compile_seconds for f in self.functions.values())

    def __call__(self, model, batch: dict, num_items_in_batch: torch.Tensor) -> torch.Tensor:
        args = (model, batch["input_ids"], batch["labels"], batch.get("position_ids"), num_items_in_batch)
        shape = tuple(batch["input_ids"].shape)
        if not self.compile:
            return forward_loss(*args, ops=self.ops)
        if self.regional and has_decoder_layout(model):
            routed = routes_logits(model)
            fn = routed_layer_region if routed else layer_region
            base = f"layer_forward{'_routed' if routed else ''}_{self.role}"

            def layer_for(layer):
                kind = layer.kind
                return self._function(("layer", kind, routed), fn, region_name(base, kind), shape)

            head = self._function("head", loss_head_region, f"head_loss_{self.role}", shape)
            return regional_loss(*args, layer_for=layer_for, head=head, ops=self.ops)
        return self._function("whole", forward_loss, f"forward_loss_{self.role}", shape)(*args, self.ops)


__all__ = ["forward_loss", "StepFunction"]
