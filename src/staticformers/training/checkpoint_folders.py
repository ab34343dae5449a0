"""Checkpoint folders: written atomically, found, verified, rotated, and RNG state captured and restored.

`output_dir/checkpoint-N/` holds the model in Hugging Face format (`config.json`,
`model.safetensors`: the fp32 master weights, so resuming is exact), `optimizer.pt`,
`scheduler.pt`, `rng_state.pth`, `training_args.json`, `trainer_state.json` (global step,
epoch, data position, log history) and the tokenizer.

Atomicity: everything is written into `output_dir/.tmp-checkpoint-N-<pid>/`, each file fsynced,
then the folder is renamed to `checkpoint-N` (one atomic rename on POSIX: the commit point) and the
parent fsynced. Only `checkpoint-<digits>` folders holding `trainer_state.json` count. What a killed
save leaves is handled by `recover_leftovers` (called by the next save and by a resume), which never
deletes the only copy of a checkpoint: a re-saved step's old folder moved aside is renamed back. Each
moment that matters is a named fault point (`utils/fault_points.py`) where the kill test stops the process.

Resuming with `resume_from_checkpoint=True` takes the newest checkpoint that `verify_checkpoint`
accepts (valid state, readable finite weights, undamaged .pt files) and says why it skipped newer ones.
The files inside a checkpoint are written by the Trainer's `save_checkpoint_files` (the
distributed layer replaces it with torch.distributed.checkpoint); this module knows folders only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import shutil
from typing import Iterator, Optional

import numpy as np
import torch

from ..utils.atomic_files import fsync_dir, fsync_tree
from ..utils.fault_points import reached
from .state import TrainerState
from .state_files import CorruptCheckpointError, verify_weights, zip_damage
from ..backends import device_kind, for_device

logger = logging.getLogger("staticformers")

PREFIX = "checkpoint"
TMP_PREFIX = ".tmp-checkpoint-"
TRAINER_STATE = "trainer_state.json"
OPTIMIZER = "optimizer.pt"
SCHEDULER = "scheduler.pt"
RNG_STATE = "rng_state.pth"
TRAINING_ARGS = "training_args.json"
DCP_FOLDER = "distributed"  # a distributed run's DCP shards of model and optimizer (training/partitioned.py)

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


OLD_PREFIX = ".old-checkpoint-"  # a re-saved step's previous folder, between the two renames
DELETING_PREFIX = ".deleting-checkpoint-"  # a rotated-out checkpoint, renamed before it is deleted
_LEFTOVER = re.compile(r"^(\.tmp-checkpoint-|\.old-checkpoint-|\.deleting-checkpoint-)(\d+)-(\d+)$")


def recover_leftovers(output_dir: str) -> list[str]:
    """Deal with what killed saves left in `output_dir`, never deleting the only copy of a checkpoint;
    returns one line per leftover handled (each also logged).

    - `.old-checkpoint-N-PID` (killed between the two renames of a re-save): renamed back to
      `checkpoint-N` when that is missing, deleted when `checkpoint-N` is complete (the swap finished);
    - `.tmp-checkpoint-N-PID` (killed before its commit rename): never a checkpoint, deleted;
    - `.deleting-checkpoint-N-PID` (killed while rotating it out): deleted, as was asked.
    """
    done = []
    if not os.path.isdir(output_dir):
        return done
    for name in sorted(os.listdir(output_dir)):
        m = _LEFTOVER.match(name)
        if not m:
            continue
        kind, step = m.group(1), int(m.group(2))
        path, final = os.path.join(output_dir, name), checkpoint_path(output_dir, int(step))
        if kind == OLD_PREFIX and not is_complete(final) and is_complete(path):
            if os.path.exists(final):
                shutil.rmtree(final)
            os.rename(path, final)
            fsync_dir(output_dir)
            line = f"recovered {final} from {name} (a save of step {step} was killed before it replaced it)"
            logger.warning("Checkpoint %s", line)
        else:
            shutil.rmtree(path, ignore_errors=True)
            line = (
                f"removed {name} ("
                + {
                    TMP_PREFIX: f"an unfinished save of step {step}, never a checkpoint",
                    OLD_PREFIX: f"the previous copy of {os.path.basename(final)}, which is complete",
                    DELETING_PREFIX: "a rotated-out checkpoint",
                }[kind]
                + ")"
            )
            logger.info("Checkpoint folder: %s", line)
        done.append(line)
    return done


def _recover_on_rank_zero(output_dir: str) -> None:
    """`recover_leftovers` by one process only (every rank of a distributed run resolves the resume path:
    they must not rename the same folder at once), the others waiting until it is done."""
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    if not distributed or dist.get_rank() == 0:
        recover_leftovers(output_dir)
    if distributed:
        dist.barrier()


def remove_stale_temporaries(output_dir: str) -> list[str]:
    """The leftovers of killed saves, handled by `recover_leftovers` (kept under its old name)."""
    return recover_leftovers(output_dir)


@contextlib.contextmanager
def atomic_checkpoint(output_dir: str, step: int) -> Iterator[str]:
    """Yield a temporary folder to write checkpoint `step` into; on success it becomes `checkpoint-step`.

    Everything must be written inside the `with` block: the rename is the commit point. On an exception
    the temporary folder is deleted and any earlier checkpoint is untouched. A re-saved step moves the
    old folder aside, renames the new one in, then deletes the old one; a kill between the two renames
    leaves the old one under `.old-checkpoint-N-PID`, which `recover_leftovers` renames back.
    """
    os.makedirs(output_dir, exist_ok=True)
    recover_leftovers(output_dir)
    tmp = os.path.join(output_dir, f"{TMP_PREFIX}{step}-{os.getpid()}")
    os.makedirs(tmp)
    try:
        yield tmp
        if not is_complete(tmp):
            raise RuntimeError(f"Checkpoint {step} was written without {TRAINER_STATE}: it was not kept.")
        reached("checkpoint:files-written")
        fsync_tree(tmp)
        reached("checkpoint:before-rename")
        final = checkpoint_path(output_dir, step)
        old = None
        if os.path.exists(final):  # the same step saved again (a resumed run): swap, then delete the old one
            old = os.path.join(output_dir, f"{OLD_PREFIX}{step}-{os.getpid()}")
            os.rename(final, old)
            reached("checkpoint:old-moved-aside")
        os.rename(tmp, final)
        fsync_dir(output_dir)
        reached("checkpoint:renamed")
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
        step = int(_NAME.match(os.path.basename(path)).group(1))
        doomed = os.path.join(output_dir, f"{DELETING_PREFIX}{step}-{os.getpid()}")
        os.rename(path, doomed)  # gone from the list in one step: never a half-deleted "complete" checkpoint
        reached("checkpoint:rotating")
        shutil.rmtree(doomed, ignore_errors=True)
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
    state = {
        "python": [version, list(internal), gauss],
        "numpy": [name, torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss), float(cached)],
        "cpu": torch.random.get_rng_state(),
    }
    if device is not None:
        own = for_device(device).rng_state(torch.device(device))
        if own is not None:
            state[device_kind(device)] = own
    return state


def restore_rng_state(state: dict, device: Optional[torch.device] = None) -> None:
    """Set every generator from `capture_rng_state`'s dict; its parts are all converted (and so checked)
    before the first generator is set."""
    version, internal, gauss = state["python"]
    python = (version, tuple(internal), gauss)
    name, keys, pos, has_gauss, cached = state["numpy"]
    numpy_state = (name, keys.numpy().astype(np.uint32), pos, has_gauss, cached)
    cpu = state["cpu"]
    if not isinstance(cpu, torch.Tensor) or cpu.dtype != torch.uint8:
        raise TypeError(f"the CPU generator state is a {type(cpu).__name__}, not a uint8 tensor")
    random.setstate(python)
    np.random.set_state(numpy_state)
    torch.random.set_rng_state(cpu)
    if device is not None and device_kind(device) in state:
        for_device(device).set_rng_state(torch.device(device), state[device_kind(device)])


def verify_checkpoint(path: str) -> Optional[str]:
    """Why checkpoint folder `path` cannot be resumed from, in one sentence, or None when it can: its
    trainer_state.json must be valid, its weights readable and finite (single-process checkpoints; the
    DCP shards of a distributed one are checked as they load), its .pt/.pth files undamaged (their zip
    checksums match)."""
    try:
        TrainerState.load_from_json(os.path.join(path, TRAINER_STATE))
    except (CorruptCheckpointError, FileNotFoundError) as err:
        return str(err)
    if not os.path.isdir(os.path.join(path, DCP_FOLDER)):
        why = verify_weights(path)
        if why:
            return why
    for name in (OPTIMIZER, SCHEDULER, RNG_STATE):
        file = os.path.join(path, name)
        if os.path.exists(file):
            why = zip_damage(file)
            if why:
                return why
    return None


def resolve_resume_path(resume_from_checkpoint, output_dir: str) -> Optional[str]:
    """`True` -> the last complete checkpoint in output_dir that can be resumed from (a newer damaged one
    is skipped with a warning saying why); a path -> that path, checked; None/False -> None."""
    if resume_from_checkpoint in (None, False):
        return None
    if resume_from_checkpoint is True:
        _recover_on_rank_zero(output_dir)
        found = [path for _, path in list_checkpoints(output_dir)]
        if not found:
            raise ValueError(
                f"resume_from_checkpoint=True but {output_dir} holds no complete checkpoint: "
                f"pass a checkpoint path, or start without resuming."
            )
        problems = []
        for path in reversed(found):
            why = verify_checkpoint(path)
            if why is None:
                if problems:
                    logger.warning(
                        "The newest checkpoint %s cannot be resumed from (%s); resuming from %s, the newest "
                        "good one, instead.",
                        problems[0][0],
                        problems[0][1],
                        path,
                    )
                return path
            problems.append((path, why))
        raise CorruptCheckpointError(
            f"No checkpoint in {output_dir} can be resumed from: the newest, {problems[0][0]}, fails with: "
            f"{problems[0][1]}"
        )
    path = os.fspath(resume_from_checkpoint)
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"Checkpoint {path} does not exist: pass a checkpoint-N folder or resume_from_checkpoint=True."
        )
    if not is_complete(path):
        raise ValueError(f"{path} is not a complete checkpoint (no {TRAINER_STATE}): pass another checkpoint-N folder.")
    return path


def previous_good_checkpoint(output_dir: str, than: str) -> Optional[str]:
    """The newest checkpoint older than `than` that `verify_checkpoint` accepts."""
    older = [
        path
        for step, path in list_checkpoints(output_dir)
        if os.path.abspath(path) != os.path.abspath(than) and step < _step_of(than)
    ]
    for path in reversed(older):
        if verify_checkpoint(path) is None:
            return path
    return None


def _step_of(path: str) -> int:
    m = _NAME.match(os.path.basename(os.path.normpath(path)))
    return int(m.group(1)) if m else 0


def last_good_checkpoint(output_dir: str) -> Optional[str]:
    """The newest checkpoint in `output_dir` that `verify_checkpoint` accepts (finite weights included)."""
    for _, path in reversed(list_checkpoints(output_dir)):
        if verify_checkpoint(path) is None:
            return path
    return None


__all__ = [
    "atomic_checkpoint",
    "list_checkpoints",
    "last_checkpoint",
    "rotate_checkpoints",
    "checkpoint_path",
    "capture_rng_state",
    "restore_rng_state",
    "resolve_resume_path",
    "remove_stale_temporaries",
    "recover_leftovers",
    "verify_checkpoint",
    "last_good_checkpoint",
    "previous_good_checkpoint",
    "TRAINER_STATE",
    "OPTIMIZER",
    "SCHEDULER",
    "RNG_STATE",
    "TRAINING_ARGS",
]
