"""Checkpoint folders: written atomically, found, rotated, and RNG state captured and restored.

`output_dir/checkpoint-N/` holds the model in Hugging Face format (`config.json`,
`model.safetensors`: the fp32 master weights, so resuming is exact), `optimizer.pt`,
`scheduler.pt`, `rng_state.pth`, `training_args.json` and `trainer_state.json` (global step,
epoch, data position, log history).

Atomicity: everything is written into `output_dir/.tmp-checkpoint-N-<pid>/`, each file fsynced,
then the folder is renamed to `checkpoint-N` (one atomic rename on POSIX) and the parent fsynced.
A process killed mid-save leaves only a temporary folder, which is never loaded (only
`checkpoint-<digits>` folders holding `trainer_state.json` count) and is removed by the next save.
The files inside a checkpoint are written by the Trainer's `save_checkpoint_files` (the
distributed layer replaces it with torch.distributed.checkpoint); this module knows folders only.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
from typing import Iterator, Optional

import numpy as np
import torch

PREFIX = "checkpoint"
TMP_PREFIX = ".tmp-checkpoint-"
TRAINER_STATE = "trainer_state.json"
OPTIMIZER = "optimizer.pt"
SCHEDULER = "scheduler.pt"
RNG_STATE = "rng_state.pth"
TRAINING_ARGS = "training_args.json"

_NAME = re.compile(rf"^{PREFIX}-(\d+)$")


def checkpoint_path(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, f"{PREFIX}-{step}")


def is_complete(path: str) -> bool:
    """A checkpoint folder counts only when its trainer_state.json is there (it is written last)."""
    return os.path.isfile(os.path.join(path, TRAINER_STATE))


def list_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """Complete checkpoints in `output_dir`, oldest step first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        m = _NAME.match(name)
        path = os.path.join(output_dir, name)
        if m and os.path.isdir(path) and is_complete(path):
            found.append((int(m.group(1)), path))
    return sorted(found)


def last_checkpoint(output_dir: str) -> Optional[str]:
    found = list_checkpoints(output_dir)
    return found[-1][1] if found else None


def _fsync_tree(path: str) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(path)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def remove_stale_temporaries(output_dir: str) -> list[str]:
    """Delete temporary folders left by saves that were killed; returns what was removed."""
    removed = []
    if os.path.isdir(output_dir):
        for name in os.listdir(output_dir):
            if name.startswith(TMP_PREFIX) or name.startswith(".old-checkpoint-"):
                shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)
                removed.append(name)
    return removed


@contextlib.contextmanager
def atomic_checkpoint(output_dir: str, step: int) -> Iterator[str]:
    """Yield a temporary folder to write checkpoint `step` into; on success it becomes `checkpoint-step`.

    On an exception the temporary folder is deleted and any earlier checkpoint is untouched.
    """
    os.makedirs(output_dir, exist_ok=True)
    remove_stale_temporaries(output_dir)
    tmp = os.path.join(output_dir, f"{TMP_PREFIX}{step}-{os.getpid()}")
    os.makedirs(tmp)
    try:
        yield tmp
        if not is_complete(tmp):
            raise RuntimeError(f"Checkpoint {step} was written without {TRAINER_STATE}: it was not kept.")
        _fsync_tree(tmp)
        final = checkpoint_path(output_dir, step)
        old = None
        if os.path.exists(final):  # the same step saved again (a resumed run): swap, then delete the old one
            old = os.path.join(output_dir, f".old-checkpoint-{step}-{os.getpid()}")
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync_dir(output_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def rotate_checkpoints(output_dir: str, save_total_limit: Optional[int], keep: Optional[str] = None) -> list[str]:
    """Delete the oldest checkpoints beyond `save_total_limit` (never `keep`); returns the deleted paths."""
    if not save_total_limit:
        return []
    found = [path for _, path in list_checkpoints(output_dir)]
    deleted = []
    excess = len(found) - save_total_limit
    for path in found:
        if excess <= 0:
            break
        if keep is not None and os.path.abspath(path) == os.path.abspath(keep):
            continue
        shutil.rmtree(path, ignore_errors=True)
        deleted.append(path)
        excess -= 1
    return deleted


def write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True, default=str)
        f.write("\n")


def read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


# ---------------------------------------------------------------------------------------------
# RNG
# ---------------------------------------------------------------------------------------------
def capture_rng_state(device: Optional[torch.device] = None) -> dict:
    """Python, NumPy, torch (and CUDA) generator states as plain lists and tensors (loadable with weights_only)."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [version, list(internal), gauss],
             "numpy": [name, torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss), float(cached)],
             "cpu": torch.random.get_rng_state()}
    if device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng_state(state: dict, device: Optional[torch.device] = None) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.random.set_rng_state(state["cpu"])
    if "cuda" in state and device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"], device)


def resolve_resume_path(resume_from_checkpoint, output_dir: str) -> Optional[str]:
    """`True` -> the last complete checkpoint in output_dir; a path -> that path, checked; None/False -> None."""
    if resume_from_checkpoint in (None, False):
        return None
    if resume_from_checkpoint is True:
        path = last_checkpoint(output_dir)
        if path is None:
            raise ValueError(f"resume_from_checkpoint=True but {output_dir} holds no complete checkpoint: "
                             f"pass a checkpoint path, or start without resuming.")
        return path
    path = os.fspath(resume_from_checkpoint)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"Checkpoint {path} does not exist: pass a checkpoint-N folder or resume_from_checkpoint=True.")
    if not is_complete(path):
        raise ValueError(f"{path} is not a complete checkpoint (no {TRAINER_STATE}): pass another checkpoint-N folder.")
    return path


__all__ = ["atomic_checkpoint", "list_checkpoints", "last_checkpoint", "rotate_checkpoints", "checkpoint_path",
           "capture_rng_state", "restore_rng_state", "resolve_resume_path", "remove_stale_temporaries",
           "TRAINER_STATE", "OPTIMIZER", "SCHEDULER", "RNG_STATE", "TRAINING_ARGS"]
