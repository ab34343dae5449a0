"""Tensor parallel and FSDP2 applied to a built `CausalLM`, by ordered functions over a named mesh.

The model code knows nothing of parallelism (ARCHITECTURE.md). Like torchtitan's
`parallelize.py`, this module applies PyTorch's own styles in a written-down order:

1. `apply_tp`: DTensor `parallelize_module` with the family's plan on the `tp` mesh:
   - q/k/v, gate/up: `ColwiseParallel` (each rank computes its own heads / MLP columns; outputs stay
     local tensors, and attention's `view(b, s, -1, head_dim)` sees the local heads);
   - o/down: `RowwiseParallel` (partial sums all-reduced, output replicated);
   - embed_tokens / lm_head: split over the vocabulary (`RowwiseParallel` on the embedding,
     `ColwiseParallel` gathering the logits); when tied both are `Shard(0)` and stay one parameter;
     a vocabulary that tp_size does not divide keeps them whole;
   - Qwen3's q_norm / k_norm act per head on local heads: `SequenceParallel` over the heads dim makes
     their weights replicated DTensors, so their gradients (partial over each rank's heads) are summed;
   - gpt-oss's attention sinks, one logit per query head: the style "sinks" makes `self_attn.sinks` a
     DTensor sharded over the heads (`Shard(0)`), so each rank holds the sinks of its own q heads and the
     attention reads their local part;
   - Qwen3.5's gated `q_proj` splits per head with its gate rows. Its Gated DeltaNet layers (Qwen3.5, Qwen3.5-MoE,
     Qwen3-Next; `models/linear_attention.py`) split over their key heads, each rank `linear_num_key_heads / tp` of
     them with the value heads they serve: the parts of `in_proj_qkv` (queries, keys, values, held apart for this),
     `in_proj_z`, `in_proj_b`, `in_proj_a` (or Qwen3-Next's `in_proj_qkvz` and `in_proj_ba`, grouped per key head)
     column-wise; the convolution's parts (style "channels") and `A_log`, `dt_bias` (style "value_heads") sharded
     over their rows as DTensors whose local part the layer reads; the gated norm (one weight per value-head dim,
     style "gated_norm") replicated with its gradient summed as q_norm's is; `out_proj` row-wise. So each rank's
     recurrent state is its own heads' (`models/kv_cache.py` sizes it with `tp`);
   - DeepSeek's latent attention: the queries (`q_b_proj` or `q_proj`) and `kv_b_proj` column-wise (each
     rank its heads' rows), `o_proj` row-wise; the latent is computed whole on every rank and cached whole,
     its gradient summed over the group (the style "latent" on `self_attn.shared_latent`);
   - a mixture's router and experts are not in the plan: without expert parallelism every TP rank
     computes every expert on the (replicated) tokens; `ep_size=tp_size` splits them instead.
2. `apply_ep` (`expert_parallel.py`, ep_size > 1): each sparse layer's experts sharded over the `ep`
   mesh, tokens exchanged in fixed-size buffers.
3. `apply_fsdp`: FSDP2 `fully_shard` per decoder block, then at the root, over `(dp_replicate, fsdp)`
   (HSDP when dp_replicate > 1), with mixed precision and CPU offload as configured; with expert
   parallelism each sparse layer's experts first, over the ranks that hold the same experts. gloo has
   no PREMUL_SUM, so FSDP is told to reduce with SUM (`set_force_sum_reduction_for_comms`).

Both work on a meta-device model (parameters are materialised later, shard by shard, by loading).
"""

from __future__ import annotations

import fnmatch
import logging
from typing import Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from .distributed_config import DistributedConfig, DistributedConfigError
from .expert_parallel import DataParallelSum, apply_ep, shard_experts
from .mesh import ParallelDims
from ..backends import device_kind, for_device

logger = logging.getLogger("staticformers")


def default_tp_plan(config) -> dict[str, str]:
    """The family's plan: {module pattern: style}. One decoder, so one plan with a flag for q/k norm and
    the dense MLP's rules where some layer has a dense MLP."""
    if config.latent_attention:  # DeepSeek: each rank its heads' queries and kv_b_proj rows, the latent whole
        query = "q_proj" if config.q_lora_rank is None else "q_b_proj"
        attention = {
            f"model.layers.*.self_attn.{query}": "colwise",
            "model.layers.*.self_attn.kv_b_proj": "colwise",
            "model.layers.*.self_attn.shared_latent": "latent",
        }
    else:
        attention = {
            "model.layers.*.self_attn.q_proj": "colwise",
            "model.layers.*.self_attn.k_proj": "colwise",
            "model.layers.*.self_attn.v_proj": "colwise",
        }
    plan = {
        "model.embed_tokens": "vocab",
        **attention,
        "model.layers.*.self_attn.o_proj": "rowwise",
        "lm_head": "vocab",
    }
    if any(not config.layer_is_sparse(i) for i in range(config.num_hidden_layers)):
        plan.update(
            {
                "model.layers.*.mlp.gate_proj": "colwise",
                "model.layers.*.mlp.up_proj": "colwise",
                "model.layers.*.mlp.down_proj": "rowwise",
            }
        )
    if config.qk_norm:
        plan["model.layers.*.self_attn.q_norm"] = "heads"
        plan["model.layers.*.self_attn.k_norm"] = "heads"
    if getattr(config.family, "attention_sinks", False):
        plan["model.layers.*.self_attn"] = "sinks"
    if config.has_linear_attention:
        plan.update(linear_attention_plan(config))
    return plan


def linear_attention_plan(config) -> dict[str, str]:
    """The Gated DeltaNet layers' rules (see the module docstring): every rank its share of the key heads."""
    layer = "model.layers.*.linear_attn"
    if config.family.fused_linear_projections:  # Qwen3-Next: rows grouped per key head, so a plain row split
        inputs = {f"{layer}.in_proj_qkvz": "colwise", f"{layer}.in_proj_ba": "colwise"}
    else:
        inputs = {f"{layer}.in_proj_qkv.[qkv]": "colwise", **{f"{layer}.in_proj_{p}": "colwise" for p in "zba"}}
    return {
        **inputs,
        f"{layer}.conv1d.[qkv]": "channels",
        layer: "value_heads",
        f"{layer}.norm": "gated_norm",
        f"{layer}.out_proj": "rowwise",
    }


def resolve_tp_plan(config, dist_config: DistributedConfig) -> dict[str, str]:
    """The auto plan with the user's rules laid over it; the vocabulary kept whole when tp does not divide it."""
    plan = default_tp_plan(config)
    if dist_config.tp_size > 1 and config.vocab_size % dist_config.tp_size:
        logger.info(
            "vocab_size=%d is not divisible by tp_size=%d: embed_tokens and lm_head stay replicated",
            config.vocab_size,
            dist_config.tp_size,
        )
        plan["model.embed_tokens"] = plan["lm_head"] = "replicate"
    if isinstance(dist_config.tp_plan, dict):
        plan.update(dist_config.tp_plan)
    return plan


class HeadsParameter(ParallelStyle):
    """Shards a module's own per-head parameters `names` over their first dim, as q_proj's rows are: rank r of the
    TP group holds the entries of its own heads. The style "sinks": gpt-oss's `sinks` `[heads]` (read through
    `models/attention_sinks.py: local_sinks`); "value_heads": a Gated DeltaNet layer's `A_log` and `dt_bias`
    `[value heads]`; "channels": a part of its depthwise convolution, `weight` `[channels, 1, K]` (each read through
    `models/linear_attention.py: local_part`)."""

    HINTS = {
        "sinks": 'attention modules with sinks ("model.layers.*.self_attn")',
        "value_heads": 'Gated DeltaNet layers ("model.layers.*.linear_attn")',
        "channels": 'the parts of a Gated DeltaNet convolution ("model.layers.*.linear_attn.conv1d.[qkv]")',
    }

    def __init__(self, style: str = "sinks", names: tuple = ("sinks",)):
        super().__init__()
        self.style, self.names = style, tuple(names)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name in self.names:
            p = module._parameters.get(name)
            if p is None:
                raise DistributedConfigError(
                    f"tp_plan style {self.style!r} shards a module's per-head `{name}`, but the {type(module).__name__} "
                    f"it was given has none: give it to {self.HINTS.get(self.style, 'modules that have it')}."
                )
            module._parameters[name] = nn.Parameter(
                distribute_tensor(p, device_mesh, [Shard(0)], src_data_rank=None), requires_grad=p.requires_grad
            )
        return module


class HeadsNorm(SequenceParallel):
    """The gated norm of a Gated DeltaNet layer (`models/linear_attention.py: GatedRMSNorm`) over this rank's value
    heads: as the style "heads" does for q_norm, its weight (one per value-head dim) becomes a replicated DTensor and
    its inputs, both of them (the heads' outputs and their gates, `[b, s, heads, dim]`), are read as sharded over
    the heads, so that the weight's gradient (each rank's is over its own heads) is summed over the group."""

    def __init__(self):
        super().__init__(sequence_dim=2, use_local_output=True)

    @staticmethod
    def _prepare_input_fn(sequence_sharding, mod, inputs, device_mesh):
        return tuple(
            t if isinstance(t, DTensor) else DTensor.from_local(t, device_mesh, sequence_sharding, run_check=False)
            for t in inputs
        )


class SharedLatent(ParallelStyle):
    """The latent that every head of a rank reads (DeepSeek's MLA, `models/latent_attention.py`): computed whole on
    each rank, its gradient (partial: a rank back-propagates through its own heads only) summed over the TP group.
    The module's output is made a replicated DTensor and read back with a partial gradient."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def hook(_module, _inputs, out):
            return DTensor.from_local(out, device_mesh, [Replicate()], run_check=False).to_local(
                grad_placements=[Partial()]
            )

        module.register_forward_hook(hook)
        return module


def _style(style: str, module: nn.Module) -> Optional[ParallelStyle]:
    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel()
    if style == "vocab":
        if isinstance(module, nn.Embedding):
            return RowwiseParallel(input_layouts=Replicate())
        return ColwiseParallel(output_layouts=Replicate())
    if style == "heads":
        return SequenceParallel(sequence_dim=2, use_local_output=True)
    if style == "sinks":
        return HeadsParameter("sinks", ("sinks",))
    if style == "value_heads":
        return HeadsParameter("value_heads", ("A_log", "dt_bias"))
    if style == "channels":
        return HeadsParameter("channels", ("weight",))
    if style == "gated_norm":
        return HeadsNorm()
    if style == "latent":
        return SharedLatent()
    return None  # "replicate"


def _matches(plan: dict[str, str], model: nn.Module) -> dict[str, str]:
    """module name -> style, every rule matching at least one module (else refused)."""
    names = [name for name, _ in model.named_modules() if name]
    chosen: dict[str, str] = {}
    for pattern, style in plan.items():
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise DistributedConfigError(
                f"tp_plan rule {pattern!r} matches no module of this model: use names like "
                f'"model.layers.*.mlp.down_proj" (see model.named_modules()).'
            )
        for name in hits:
            chosen[name] = style
    return chosen


def tp_styles(model: nn.Module, chosen: dict[str, str]) -> dict[str, str]:
    """`chosen` with each module that wraps a projection (a LoRA layer: `tensor_parallel_plan`) replaced by
    the styles of its parts, which follow the style given to it."""
    out: dict[str, str] = {}
    for name, style in chosen.items():
        plan = getattr(model.get_submodule(name), "tensor_parallel_plan", None)
        if plan is None:
            out[name] = style
        else:
            out.update({f"{name}.{part}": s for part, s in plan(style).items()})
    return out


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, str]) -> None:
    """Shard the model's modules over `tp_mesh` by `plan`; tied embeddings stay one parameter."""
    chosen = _matches(plan, model)
    tied = model.config.tie_word_embeddings
    if tied and chosen.get("model.embed_tokens") != chosen.get("lm_head"):
        raise DistributedConfigError(
            f"embed_tokens and lm_head share one weight (tie_word_embeddings), but tp_plan gives them different "
            f"styles ({chosen.get('model.embed_tokens')!r} and {chosen.get('lm_head')!r}): give both the same."
        )
    styles = {}
    for name, style in tp_styles(model, chosen).items():
        s = _style(style, model.get_submodule(name))
        if s is not None:
            styles[name] = s
    parallelize_module(model, tp_mesh, styles)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight


def fsdp_kwargs(model: nn.Module, dims: ParallelDims) -> dict:
    """`fully_shard`'s arguments for this layout: the data-parallel mesh, resharding, mixed precision, offload."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    config = dims.config
    mesh = dims.dp_mesh if config.dp_replicate_size > 1 else dims.mesh["fsdp"]
    kwargs = {"mesh": mesh, "reshard_after_forward": config.reshard_after_forward}
    if config.param_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=config.param_dtype, reduce_dtype=torch.float32)
    if config.fsdp_cpu_offload:
        device = next(iter(model.parameters())).device
        if (device_kind(device) == "meta" or for_device(device).hosts_memory) and not _accelerator_present():
            logger.info("fsdp_cpu_offload=True has nothing to do on the CPU: the shards already live in host memory")
        else:
            kwargs["offload_policy"] = CPUOffloadPolicy()
    return kwargs


def apply_fsdp(model: nn.Module, dims: ParallelDims, backend: str) -> None:
    """FSDP2 `fully_shard` on each decoder block, then on the root, over the data-parallel mesh."""
    from torch.distributed.fsdp import fully_shard

    kwargs = fsdp_kwargs(model, dims)
    if dims.ep > 1:
        shard_experts(model, dims, kwargs, backend)
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    if backend == "gloo":
        model.set_force_sum_reduction_for_comms(True)


def _accelerator_present() -> bool:
    acc = getattr(torch, "accelerator", None)
    return bool(acc is not None and acc.is_available())


def parallelize(model: nn.Module, dims: ParallelDims, backend: str) -> nn.Module:
    """Tensor parallel, expert parallel, then FSDP2 (torchtitan's order); returns the same module, partitioned."""
    if dims.tp > 1:
        apply_tp(model, dims.tp_mesh, resolve_tp_plan(model.config, dims.config))
    if dims.ep > 1:
        apply_ep(model, dims)
    if dims.dp > 1:
        apply_fsdp(model, dims, backend)
    model.parallel_dims = dims
    if dims.dp > 1 and getattr(model.config, "is_moe", False):
        model.data_parallel = DataParallelSum(dims)  # the load-balancing loss over the whole batch
    return model


__all__ = [
    "HeadsParameter",
    "HeadsNorm",
    "SharedLatent",
    "default_tp_plan",
    "linear_attention_plan",
    "resolve_tp_plan",
    "apply_tp",
    "apply_fsdp",
    "fsdp_kwargs",
    "parallelize",
    "tp_styles",
]
