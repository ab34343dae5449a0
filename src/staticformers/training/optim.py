"""Optimizer, precision and learning-rate schedule for the Trainer.

The bf16 recipe (`bf16=True`): **bf16 weights and activations, fp32 master weights, fp32 optimizer
state, fp32 loss and norms.** The model's parameters are cast to bf16 in place, so forward and
backward run bf16 matmuls with no per-step weight casts (what makes bf16 fast on Neuron and on
CPUs with bf16 units). Each micro-batch's bf16 gradients are added into fp32 gradient buffers
(accumulation never happens in bf16); AdamW updates the fp32 master weights; the result is copied
back into the bf16 parameters. The model already computes RMSNorm, softmax and the cross-entropy
in fp32. This is the Megatron/Neuron "master weights" recipe; unlike autocast it keeps no fp32
weights in the compiled graph and needs no loss scaling (bf16 has fp32's exponent range).
Without bf16 the weights are trained in fp32 and the master weights are the parameters themselves.

AdamW puts no weight decay on biases and normalisation weights (nor on any 1-D parameter).
Schedules follow transformers' formulas: linear, cosine, constant, constant_with_warmup.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

import torch
from torch import nn

from ..backends import for_device


def no_decay_parameter_names(model: nn.Module) -> set[str]:
    """Names of the parameters that get no weight decay: biases, normalisation weights, 1-D tensors."""
    names = set()
    for module_name, module in model.named_modules():
        is_norm = "norm" in type(module).__name__.lower() or isinstance(module, (nn.LayerNorm, nn.GroupNorm))
        for name, p in module.named_parameters(recurse=False):
            full = f"{module_name}.{name}" if module_name else name
            if is_norm or name == "bias" or p.ndim < 2:
                names.add(full)
    return names


class MasterWeights:
    """The trainable parameters and their fp32 master copies (the parameters themselves when fp32).

    `params` are the model's parameters (deduplicated, tied weights once), `names` their names,
    `master` what the optimizer updates. `collect_grads()` moves low-precision gradients into the
    fp32 buffers after each backward; `push()` copies updated master weights into the model.
    """

    def __init__(self, model: nn.Module, copies: bool = True):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.master = [
            p if (p.dtype == torch.float32 or not copies) else p.detach().float().clone().requires_grad_(True)
            for p in self.params
        ]
        self._low = [i for i, (p, m) in enumerate(zip(self.params, self.master)) if m is not p]

    @property
    def has_copies(self) -> bool:
        return bool(self._low)

    def by_name(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.master))

    def collect_grads(self) -> None:
        for i in self._low:
            p, m = self.params[i], self.master[i]
            if p.grad is None:
                continue
            if m.grad is None:
                m.grad = p.grad.float()
            else:
                m.grad.add_(p.grad)
            p.grad = None

    @torch.no_grad()
    def push(self) -> None:
        if self._low:
            torch._foreach_copy_([self.params[i] for i in self._low], [self.master[i] for i in self._low])

    @torch.no_grad()
    def adopt(self, originals: dict) -> None:
        """Start each fp32 master copy from the parameter's value before it was cast to low precision
        ({id(parameter): tensor}), not from the rounded copy: a bf16 run of an fp32 model loses nothing."""
        for i in self._low:
            original = originals.get(id(self.params[i]))
            if original is not None and original.dtype == torch.float32 and original.shape == self.master[i].shape:
                self.master[i].copy_(original)

    @torch.no_grad()
    def load(self, tensors: dict) -> None:
        """Set master weights and parameters from a {name: tensor} dict (a checkpoint's weights)."""
        for name, p, m in zip(self.names, self.params, self.master):
            if name not in tensors:
                continue
            m.copy_(tensors[name])
            if m is not p:
                p.copy_(m)

    def grads(self) -> list[torch.Tensor]:
        return [m.grad for m in self.master if m.grad is not None]


def parameter_groups(model: nn.Module, master: MasterWeights, weight_decay: float) -> list[dict]:
    """AdamW groups over the master weights: decay on matrices, none on norms and biases."""
    skip = no_decay_parameter_names(model)
    decay = [m for n, m in zip(master.names, master.master) if n not in skip]
    no_decay = [m for n, m in zip(master.names, master.master) if n in skip]
    groups = []
    if decay:
        groups.append({"params": decay, "weight_decay": weight_decay})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def create_adamw(groups: list[dict], lr: float, betas: tuple, eps: float, fused: bool = True) -> torch.optim.Optimizer:
    """torch's AdamW, eager: the fused kernel (one pass over the weights) on the CPU and CUDA, where
    torch has it and `fused` asks for it (`optim="adamw_torch_fused"`); the foreach implementation
    otherwise (`optim="adamw_torch"`, and Neuron, XPU, MPS)."""
    params = [p for g in groups for p in g["params"]]
    fused = fused and bool(params) and all(for_device(p.device).fused_optimizer for p in params)
    if fused:
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=True)


def schedule_lambda(name: str, warmup: int, total: int, num_cycles: float = 0.5):
    """lr multiplier per step, transformers' formulas (`num_cycles`: cosine's, from lr_scheduler_kwargs)."""
    total = max(total, 1)

    def warm(step: int) -> Optional[float]:
        return step / max(1, warmup) if step < warmup else None

    if name == "constant":
        return lambda step: 1.0
    if name == "constant_with_warmup":
        return lambda step: warm(step) if warm(step) is not None else 1.0
    if name == "linear":
        return lambda step: warm(step) if warm(step) is not None else max(0.0, (total - step) / max(1, total - warmup))
    if name == "cosine":

        def cosine(step: int) -> float:
            w = warm(step)
            if w is not None:
                return w
            progress = (step - warmup) / max(1, total - warmup)
            return max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress)))

        return cosine
    raise ValueError(
        f"lr_scheduler_type={name!r} is not supported: use linear, cosine, constant or constant_with_warmup."
    )


def create_scheduler(optimizer: torch.optim.Optimizer, name: str, warmup: int, total: int, **kwargs):
    """`kwargs`: the schedule's own arguments (lr_scheduler_kwargs, checked by TrainingArguments)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule_lambda(name, warmup, total, **kwargs))


def clip_grad_norm(grads: Iterable[torch.Tensor], max_norm: Optional[float]) -> torch.Tensor:
    """The global L2 norm of `grads` (fp32), scaling them down to `max_norm` when above it (0/None: measure only).

    The distributed layer replaces this with a per-mesh-group norm (see Trainer.clip_gradients).
    """
    grads = [g for g in grads if g is not None]
    if not grads:
        return torch.zeros(())
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)).float(), 2.0)
    if max_norm:
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(grads, scale.to(grads[0].dtype))
    return norm


__all__ = [
    "MasterWeights",
    "parameter_groups",
    "create_adamw",
    "create_scheduler",
    "schedule_lambda",
    "clip_grad_norm",
    "no_decay_parameter_names",
]
