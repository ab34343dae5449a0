"""Whether PyTorch module hooks are set: what code that reads weights directly, or runs a graph traced
without them, must check first.

Compiled steps that share one graph across layers, formulations that read `weight` and `bias`
themselves and saved graphs loaded without a trace would all skip a hook silently. They ask here.
"""

from __future__ import annotations

from torch import nn

_FORWARD = ("_forward_hooks", "_forward_pre_hooks")
_BACKWARD = ("_backward_hooks", "_backward_pre_hooks")


def global_hook_ids(backward: bool = False) -> tuple:
    """The handles of the hooks registered for every module, per kind (forward, and with `backward`
    backward ones); they change with each registration or removal."""
    from torch.nn.modules import module as nn_module

    names = _FORWARD + (_BACKWARD if backward else ())
    return tuple(tuple(getattr(nn_module, "_global" + name, None) or ()) for name in names)


def global_hooks(backward: bool = False) -> bool:
    """Whether hooks registered for every module are set (forward, and with `backward` backward ones)."""
    return any(global_hook_ids(backward))


def hooked(module: nn.Module, backward: bool = False) -> bool:
    """Whether `module` itself has forward hooks (and with `backward` backward ones)."""
    names = _FORWARD + (_BACKWARD if backward else ())
    return any(getattr(module, name, None) for name in names)


def any_hooked(model: nn.Module, backward: bool = False) -> bool:
    """Whether any module of `model`, or every module globally, has hooks."""
    return global_hooks(backward) or any(hooked(m, backward) for m in model.modules())


def forward_hook_state(modules: list) -> tuple:
    """The forward hooks set on `modules` (by position) and globally: equal tuples mean the same hooks."""
    own = tuple(
        (i, tuple(m._forward_hooks), tuple(m._forward_pre_hooks))
        for i, m in enumerate(modules)
        if m._forward_hooks or m._forward_pre_hooks
    )
    return own, global_hook_ids()
