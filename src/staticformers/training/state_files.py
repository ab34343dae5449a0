"""Reading the files of a training checkpoint at resume: each failure one sentence naming the file.

A resumed run reads `model.safetensors` (or its shards), `optimizer.pt`, `scheduler.pt`,
`rng_state.pth` and `trainer_state.json`. Any of them can be truncated by a full disk, damaged, or
replaced by someone else's file. Here:

- weights go through the checked safetensors reader (`loading.open_weights`: header, sizes and
  truncation checked; names inside the folder), each tensor's name and shape must match, and every
  value must be finite;
- `.pt` / `.pth` files are read with `torch.load(weights_only=True)`, which builds only tensors and
  plain Python values and never runs code from the file (a pickle payload is refused), and a file
  that does not fit the optimizer, scheduler or RNG is refused too;
- every failure is a `CorruptCheckpointError` (a `FileNotFoundError` for a missing file) whose
  sentence names the file and says what to do.
"""

from __future__ import annotations

import math
import os
import zipfile
from typing import Any, Callable, Iterable, Optional

import torch

RESUME_ADVICE = "resume from another checkpoint-N folder, or start without resuming"


class CorruptCheckpointError(ValueError):
    """A checkpoint file that cannot be read back, or does not fit the run being resumed."""


def _missing(path: str) -> FileNotFoundError:
    return FileNotFoundError(f"{path} is missing, so the checkpoint is incomplete: {RESUME_ADVICE}.")


def zip_damage(path: str) -> Optional[str]:
    """Why the `torch.save` file at `path` is damaged (not a zip, or a member whose checksum fails), or None.
    torch.load itself reads a file with flipped bytes without noticing."""
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as err:
        return f"{path} is damaged or truncated ({err})"
    return f"{path} is damaged (member {bad} fails its checksum)" if bad else None


def load_torch_file(path: str, map_location: Any = None) -> Any:
    """`torch.load(path, weights_only=True)`, with one sentence for a missing, damaged or unsafe file."""
    if not os.path.isfile(path):
        raise _missing(path)
    damage = zip_damage(path)
    if damage:
        raise CorruptCheckpointError(f"{damage}: {RESUME_ADVICE}.")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:  # UnpicklingError (a payload), RuntimeError (a damaged zip), EOFError, ...
        reason = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
        raise CorruptCheckpointError(
            f"{path} cannot be read ({reason}): it is damaged or holds more than tensors and plain values "
            f"(nothing in it was run); {RESUME_ADVICE}."
        ) from None


def apply_state(path: str, what: str, apply: Callable[[Any], None], state: Any) -> None:
    """Hand `state` (read from `path`) to `apply` (a `load_state_dict`); a state that does not fit is refused."""
    try:
        apply(state)
    except (KeyError, ValueError, TypeError, IndexError, RuntimeError, AttributeError) as err:
        raise CorruptCheckpointError(
            f"{path} does not fit this run's {what} ({type(err).__name__}: {str(err)[:160]}): it belongs to another "
            f"run or is damaged; {RESUME_ADVICE}."
        ) from None


def apply_file(path: str, what: str, apply: Callable[[Any], None], map_location: Any = None) -> None:
    """Load `path` and hand it to `apply`, both checked."""
    apply_state(path, what, apply, load_torch_file(path, map_location))


def _number(value: Any) -> bool:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = float(value)
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_optimizer_state(optimizer: torch.optim.Optimizer, path: str) -> None:
    """After `load_state_dict`: the hyper-parameters the file brought are finite and in range, and every
    per-parameter state tensor has its parameter's shape and finite values (torch checks only counts)."""

    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{path} does not fit this run's optimizer ({why}): it belongs to another run or "
            f"is damaged; {RESUME_ADVICE}."
        )

    for i, group in enumerate(optimizer.param_groups):
        for key in ("lr", "initial_lr", "eps", "weight_decay"):
            if key in group and not (_number(group[key]) and float(group[key]) >= 0):
                raise bad(f"group {i} has {key}={group[key]!r}")
        betas = group.get("betas")
        if betas is not None and not (
            isinstance(betas, (tuple, list))
            and len(betas) == 2
            and all(_number(b) and 0 <= float(b) < 1 for b in betas)
        ):
            raise bad(f"group {i} has betas={betas!r}")
        for p in group["params"]:
            for name, value in optimizer.state.get(p, {}).items():
                if not isinstance(value, torch.Tensor):
                    continue
                if value.ndim > 0 and tuple(value.shape) != tuple(p.shape):
                    raise bad(f"its {name} has shape {list(value.shape)} for a parameter of shape {list(p.shape)}")
                if not _finite(value):
                    raise bad(f"its {name} holds NaN or infinite values")


def check_scheduler_state(state: Any, path: str, groups: int) -> None:
    """The values a learning-rate scheduler's state holds, checked before `load_state_dict` applies them."""

    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{path} does not fit this run's learning-rate scheduler ({why}): it belongs to "
            f"another run or is damaged; {RESUME_ADVICE}."
        )

    if not isinstance(state, dict):
        raise bad(f"it holds a {type(state).__name__}, not a state dict")
    for key in ("base_lrs", "_last_lr"):
        if key in state and not (
            isinstance(state[key], list)
            and len(state[key]) == groups
            and all(_number(v) and float(v) >= 0 for v in state[key])
        ):
            raise bad(f"{key}={state[key]!r}")
    for key, low in (("last_epoch", -1), ("_step_count", 0)):
        value = state.get(key, low)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise bad(f"{key}={value!r}")


def _finite(tensor: torch.Tensor) -> bool:
    if hasattr(tensor, "to_local"):  # a DTensor: this rank's shard
        tensor = tensor.to_local()
    if not tensor.is_floating_point():
        return True
    flat = tensor.detach().reshape(-1)
    return all(bool(torch.isfinite(part).all()) for part in flat.split(1 << 24))  # bounded temporaries


def nonfinite(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of the tensors holding a NaN or an infinity."""
    return [name for name, tensor in named if not _finite(tensor)]


def read_weights(directory: str, expected: dict[str, tuple], names=None) -> dict[str, torch.Tensor]:
    """The weights of checkpoint `directory` named in `expected` (name -> shape), checked (see the module
    docstring) before any is used; a LoRA run's checkpoint holds its adapter alone (PEFT's files).
    `names`: the family's checkpoint-name adapter (`checkpoints/names.py`: a mixture of experts' files hold
    one tensor per expert, stacked here); None: the identity."""
    from ..adapters.files import AdapterFileError, read_checkpoint_adapter
    from ..checkpoints.names import CheckpointNames, file_shapes
    from ..models.pretrained import CheckpointError, open_weights, weight_files

    try:
        adapter = read_checkpoint_adapter(directory, expected, getattr(names, "fused", None))
    except AdapterFileError as err:
        raise CorruptCheckpointError(f"{err} ({RESUME_ADVICE})") from None
    if adapter is not None:
        bad = nonfinite(adapter.items())
        if bad:
            raise CorruptCheckpointError(
                f"Checkpoint {directory} holds NaN or infinite weights ({', '.join(bad[:3])}): "
                f"it is not a good checkpoint; {RESUME_ADVICE}."
            )
        return adapter
    try:
        files = weight_files(directory)
    except (CheckpointError, FileNotFoundError) as err:
        raise CorruptCheckpointError(f"{err} ({RESUME_ADVICE})") from None
    names = names or CheckpointNames()
    present = set()
    for path in files:
        try:
            with open_weights(path) as f:
                present.update(f.keys())
        except CheckpointError as err:
            raise CorruptCheckpointError(f"{err} ({RESUME_ADVICE})") from None
    layout = names.layout(expected, present)
    target_names, expected = expected, file_shapes(layout)
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            with open_weights(path) as f:
                for name in f.keys():
                    if name not in expected:
                        continue
                    if tuple(f.shape(name)) != tuple(expected[name]):
                        raise CorruptCheckpointError(
                            f"Weight {name} in {path} has shape {list(f.shape(name))}, not {list(expected[name])}: "
                            f"the checkpoint belongs to another model; {RESUME_ADVICE}."
                        )
                    tensors[name] = f.read(name)
        except CheckpointError as err:
            raise CorruptCheckpointError(f"{err} ({RESUME_ADVICE})") from None
    missing = [n for n in expected if n not in tensors]
    if missing:
        raise CorruptCheckpointError(
            f"Checkpoint {directory} lacks weights {', '.join(missing[:5])}: it belongs to "
            f"another model; {RESUME_ADVICE}."
        )
    bad = nonfinite(tensors.items())
    if bad:
        raise CorruptCheckpointError(
            f"Checkpoint {directory} holds NaN or infinite weights ({', '.join(bad[:3])}): "
            f"it is not a good checkpoint; {RESUME_ADVICE}."
        )
    assembled = names.assemble(layout, tensors)
    return {name: assembled[name] for name in target_names}


def verify_weights(directory: str) -> Optional[str]:
    """Why the weights of `directory` cannot be resumed from (damaged, truncated, non-finite), or None.
    Reads one tensor at a time (an adapter checkpoint: its adapter file, checked whole)."""
    from ..adapters.files import ADAPTER_WEIGHTS, AdapterFileError, read_weights as read_adapter_weights
    from ..models.pretrained import CheckpointError, open_weights, weight_files

    adapter = os.path.join(directory, ADAPTER_WEIGHTS)
    if os.path.isfile(adapter):
        try:
            read_adapter_weights(adapter)
        except (AdapterFileError, OSError) as err:
            return str(err)
        return None
    try:
        for path in weight_files(directory):
            with open_weights(path) as f:
                for name in f.keys():
                    if not _finite(f.read(name)):
                        return f"weight {name} in {os.path.basename(path)} is NaN or infinite"
    except (CheckpointError, FileNotFoundError, OSError) as err:
        return str(err)
    return None


__all__ = [
    "CorruptCheckpointError",
    "zip_damage",
    "load_torch_file",
    "apply_state",
    "apply_file",
    "check_optimizer_state",
    "check_scheduler_state",
    "read_weights",
    "verify_weights",
    "nonfinite",
    "RESUME_ADVICE",
]
