"""The compiled training and evaluation functions, and the count of graphs they build.

`forward_loss(model, batch...)` runs the model with labels and returns the loss. With
`torch_compile=True` it is compiled with the device's backend (`fullgraph=True, dynamic=False`)
as two regions: one decoder layer (`layer_forward`), whose graph every layer of the model reuses
(their parameters are graph inputs, not constants), and the head (final norm, lm_head and loss,
`head_loss`). AOTAutograd derives each region's backward, `loss.backward()` runs them; embedding,
masks and rotary tables (a handful of small ops) and the optimizer step stay eager. Compiling one
layer instead of all of them is what keeps the first step short: the compiler's work no longer
grows with depth (on the 8-layer reference model the cold first step falls from about 65 s to about
half that), while each step still runs the same fused kernels. Models without the decoder layout
(`model.model.prepare`, `.run_layers`) are compiled whole, as one graph.

The model object is never wrapped, so its state dict keeps its names and the caller's model is the
one that trains. Every batch has the same shapes and dtypes and the token count
(`num_items_in_batch`) is a 0-d tensor, not a Python number, so nothing is specialised on values:
a run builds a fixed set of graphs (per role: one per distinct attention window among the layers,
plus the head) and never more. `CountingBackend` counts the graphs the backend is handed (and the
seconds spent compiling them) so tests and logs can prove it.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch

from ..compile import fresh_code
from ..modeling import has_decoder_layout


def forward_loss(model, input_ids, labels, position_ids, num_items_in_batch):
    """Loss of one batch: summed token losses divided by `num_items_in_batch` (a 0-d tensor)."""
    return model(input_ids=input_ids, labels=labels, position_ids=position_ids,
                 num_items_in_batch=num_items_in_batch).loss


def layer_forward(layer, x, cos, sin, masks, kv_cache=None, cache_position=None):
    """One decoder layer (the compiled region every layer shares)."""
    return layer(x, cos, sin, masks, kv_cache, cache_position)


def head_loss(model, hidden, labels, num_items_in_batch):
    """Final norm, lm_head and the summed-then-divided loss (the compiled head region)."""
    from ..modeling import causal_lm_loss

    return causal_lm_loss(model.lm_head(model.model.norm(hidden)), labels, num_items_in_batch)


def regional_forward_loss(model, input_ids, labels, position_ids, num_items_in_batch,
                          layer_fn: Callable = layer_forward, head_fn: Callable = head_loss):
    """`forward_loss` with the layers run by `layer_fn` and the head by `head_fn` (compiled regions)."""
    decoder = model.model
    x, cos, sin, masks = decoder.prepare(input_ids, position_ids=position_ids)
    return head_fn(model, decoder.run_layers(x, cos, sin, masks, call=layer_fn), labels, num_items_in_batch)


class CountingBackend:
    """A torch.compile backend that counts the graphs it compiles and delegates to `backend`."""

    def __init__(self, backend: Any):
        self.backend = backend
        self.graphs = 0
        self.compile_seconds = 0.0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        from torch._dynamo.backends.registry import lookup_backend

        self.graphs += 1
        start = time.perf_counter()
        inner = lookup_backend(self.backend) if isinstance(self.backend, str) else self.backend
        compiled = inner(gm, example_inputs)
        self.compile_seconds += time.perf_counter() - start
        return compiled


class StepFunction:
    """`forward_loss` compiled (or not) for one role ("train" or "eval"), with its graph count.

    `regional=True` (the default when compiling) compiles the layer and head regions; `False`
    compiles the whole forward and loss as one graph (used for models without our decoder layout)."""

    def __init__(self, role: str, compile: bool, backend: Optional[str], regional: bool = True):
        if compile and backend == "inductor":
            try:  # the shared on-disk compile cache: a second process compiles nothing it compiled before
                from ..compile import enable_persistent_cache

                enable_persistent_cache()
            except ImportError:  # pragma: no cover
                pass
        self.role = role
        self.regional = compile and regional
        self.counter = CountingBackend(backend) if compile else None
        options = dict(backend=self.counter, fullgraph=True, dynamic=False)
        # own code objects per role: Dynamo caches graphs (and counts its recompile limit) per code object
        self.whole: Callable = fresh_code(forward_loss, f"forward_loss_{role}")
        if compile:
            self.whole = torch.compile(self.whole, **options)
        if self.regional:
            self.layer_fn = torch.compile(fresh_code(layer_forward, f"layer_forward_{role}"), **options)
            self.head_fn = torch.compile(fresh_code(head_loss, f"head_loss_{role}"), **options)

    @property
    def graphs(self) -> int:
        return self.counter.graphs if self.counter is not None else 0

    @property
    def compile_seconds(self) -> float:
        return self.counter.compile_seconds if self.counter is not None else 0.0

    def __call__(self, model, batch: dict, num_items_in_batch: torch.Tensor) -> torch.Tensor:
        args = (model, batch["input_ids"], batch["labels"], batch.get("position_ids"), num_items_in_batch)
        if self.regional and has_decoder_layout(model):
            return regional_forward_loss(*args, layer_fn=self.layer_fn, head_fn=self.head_fn)
        return self.whole(*args)


__all__ = ["forward_loss", "layer_forward", "head_loss", "regional_forward_loss", "CountingBackend", "StepFunction"]
