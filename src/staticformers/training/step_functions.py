"""The compiled training and evaluation functions, and the count of graphs they build.

`forward_loss(model, batch...)` runs the model with labels and returns the loss. With
`torch_compile=True` it is compiled with the device's backend (`fullgraph=True, dynamic=False`)
as regions: one decoder layer (`layer_forward`), whose graph every layer of the model reuses (their
parameters are graph inputs, not constants; one layer function per distinct layer kind: attention
window, dense or sparse MLP), and the head (final norm, lm_head and loss, `head_loss`). A mixture of
experts trained with `output_router_logits` runs `layer_forward_routed`, whose regions also return the
router logits, and the head adds the load-balancing loss (`moe.load_balancing_loss`) to the loss: the
same regions, one graph each. AOTAutograd derives each region's backward,
`loss.backward()` runs them; embedding, masks and rotary tables (a handful of small ops) and the
optimizer step stay eager. Compiling one layer instead of all of them is what keeps the first step
short: the compiler's work no longer grows with depth, while each step still runs the same fused
kernels. Models without the decoder layout (`model.model.prepare`, `.run_layers`) are compiled
whole, as one graph.

Every region goes through the one compile path (`compile.compile_function`): counted, one graph per
function (a second one is a violation of the fixed shapes, raised in strict mode). The model object
is never wrapped, so its state dict keeps its names and the caller's model is the one that trains.
Every batch has the same shapes and dtypes and the token count (`num_items_in_batch`) is a 0-d
tensor, not a Python number, so nothing is specialised on values. `ops` is the device backend's
formulation for training (`backends.Backend.training_ops`).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..compilation.compiler import CompiledFunction, compile_function, enable_persistent_cache
from ..models.decoder import causal_lm_loss, has_decoder_layout, layer_suffix
from ..models.moe import load_balancing_loss
from ..models.ops import PLAIN, Ops


def forward_loss(model, input_ids, labels, position_ids, num_items_in_batch, ops=PLAIN):
    """Loss of one batch: summed token losses divided by `num_items_in_batch` (a 0-d tensor)."""
    kwargs = {"ops": ops} if has_decoder_layout(model) else {}
    return model(input_ids=input_ids, labels=labels, position_ids=position_ids,
                 num_items_in_batch=num_items_in_batch, **kwargs).loss


def layer_forward(layer, x, cos, sin, masks, kv_cache=None, position_ids=None, ops=PLAIN):
    """One decoder layer (the compiled region every layer of its kind shares)."""
    return layer(x, cos, sin, masks, kv_cache, position_ids, ops)


def layer_forward_routed(layer, x, cos, sin, masks, kv_cache=None, position_ids=None, ops=PLAIN):
    """One decoder layer and its router logits (None for a dense layer): a routed model's layer region."""
    return layer(x, cos, sin, masks, kv_cache, position_ids, ops, routed=True)


def routes_logits(model) -> bool:
    """Whether the model's loss includes the load-balancing loss (a mixture of experts with output_router_logits)."""
    config = getattr(model, "config", None)
    return bool(getattr(config, "is_moe", False) and config.output_router_logits)


def head_loss(model, hidden, labels, num_items_in_batch, ops=PLAIN, router_logits: tuple = ()):
    """Final norm, lm_head and the summed-then-divided loss, plus the load-balancing loss of `router_logits`
    times `router_aux_loss_coef` when given (the compiled head region)."""
    loss = causal_lm_loss(ops.head(model.lm_head, model.model.norm(hidden)), labels, num_items_in_batch)
    if router_logits:
        c = model.config
        aux = load_balancing_loss(router_logits, c.num_experts, c.num_experts_per_tok, None, model.data_parallel,
                                  share=True)
        loss = loss + c.router_aux_loss_coef * aux
    return loss


def regional_forward_loss(model, input_ids, labels, position_ids, num_items_in_batch,
                          layer_fn: Callable = None, head_fn: Callable = head_loss, ops: Ops = PLAIN):
    """`forward_loss` with the layers run by `layer_fn(layer)` (the layer's compiled region: `layer_forward`,
    or `layer_forward_routed` for a routed model) and the head by `head_fn`."""
    decoder = model.model
    routed = routes_logits(model)
    if layer_fn is None:
        plain = layer_forward_routed if routed else layer_forward
        layer_fn = lambda layer: plain  # noqa: E731
    x, cos, sin, masks = decoder.prepare(input_ids, position_ids=position_ids)
    if torch.is_grad_enabled() and not x.requires_grad and _layers_train(decoder):
        # a frozen embedding (LoRA) feeds the first layer a tensor without grad, every later layer one with:
        # the layer region would need two graphs; one graph it is, with the first input's gradient unused
        x = x.detach().requires_grad_(True)

    def call(layer, x, cos, sin, masks, kv_cache=None, position_ids=None, ops=ops):
        return layer_fn(layer)(layer, x, cos, sin, masks, kv_cache, position_ids, ops)

    router = [] if routed else None
    hidden = decoder.run_layers(x, cos, sin, masks, call=call, ops=ops, router_logits=router)
    return head_fn(model, hidden, labels, num_items_in_batch, ops, tuple(router or ()))


def _layers_train(decoder) -> bool:
    return any(p.requires_grad for p in decoder.layers[0].parameters())


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
            fn = layer_forward_routed if routed else layer_forward

            def layer_fn(layer):
                name = f"layer_forward{'_routed' if routed else ''}_{self.role}{layer_suffix(layer)}"
                return self._function(("layer", layer.kind, routed), fn, name, shape)

            head = self._function("head", head_loss, f"head_loss_{self.role}", shape)
            return regional_forward_loss(*args, layer_fn=layer_fn, head_fn=head, ops=self.ops)
        return self._function("whole", forward_loss, f"forward_loss_{self.role}", shape)(*args, self.ops)


__all__ = ["forward_loss", "layer_forward", "layer_forward_routed", "routes_logits", "head_loss",
           "regional_forward_loss", "StepFunction"]
