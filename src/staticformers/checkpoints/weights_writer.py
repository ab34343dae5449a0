"""Writing a model's safetensors files into a folder that may hold another model's, with no moment at
which a kill leaves neither.

`save_pretrained` into an existing folder used to delete the old weights and then write the new
ones: a kill in between left a folder with no weights. Here the new files are written first under
hidden temporary names (`.model-00001-of-00002.tmp-<pid>.safetensors`), flushed, and only then put in
place, in an order where the folder loads, at every instant, either the old model or the new one:

- one file: `model.safetensors` is replaced in one rename; an older index (which loaders prefer)
  is removed after it, so until then the old shards still load;
- shards whose names are free: renamed into place, then the index is written in one rename (the
  commit point);
- shards whose names the old shards hold (same count): an index naming the temporary files is
  committed first, the old shards are replaced by hard links to the new ones (a copy where links
  are not supported), then the final index is committed and the temporary names removed.

Files of the old model that the new one does not use are deleted last. Leftover temporary files of
a killed save are deleted by the next one, except any the current index names (they hold the
committed weights then).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Optional

import torch

from ..utils.atomic_files import fsync_dir, fsync_file, write_text_atomic
from ..utils.fault_points import reached
from .safetensors_io import save_file

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
_WEIGHT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")
_OUR_TEMPORARIES = re.compile(
    r"\.model.*\.tmp-\d+(-\d+)?\.safetensors|\.(model.*|config\.json|generation_config\.json)\.tmp-\d+"
)


def _staged(final: str) -> str:
    """A new weight file's temporary path: hidden, with the pid, still ending in .safetensors (transformers picks
    its reader by the extension when an index names the file), and never a name that exists already (a
    killed save of a process with the same pid may have left one that the index names)."""
    folder, name = os.path.split(final)
    stem, n = name.removesuffix(".safetensors"), 0
    while True:
        path = os.path.join(folder, f".{stem}.tmp-{os.getpid()}{f'-{n}' if n else ''}.safetensors")
        if not os.path.lexists(path):
            return path
        n += 1


def shard_names(count: int) -> list[str]:
    if count == 1:
        return [SAFE_WEIGHTS]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _indexed_names(directory: str) -> set[str]:
    try:
        with open(os.path.join(directory, SAFE_INDEX), encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
        return {v for v in weight_map.values() if isinstance(v, str)}
    except (OSError, ValueError, AttributeError):
        return set()


def remove_leftovers(directory: str) -> list[str]:
    """Delete temporary files killed saves left in `directory` (never one the index names)."""
    keep = _indexed_names(directory)
    removed = []
    for name in os.listdir(directory):
        if _OUR_TEMPORARIES.fullmatch(name) and name not in keep:
            os.remove(os.path.join(directory, name))
            removed.append(name)
    return removed


def _write_index(directory: str, weight_map: dict, total: int) -> None:
    text = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    write_text_atomic(os.path.join(directory, SAFE_INDEX), text)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
        fsync_file(dst)


def write_weights(directory: str, shards: list[dict[str, torch.Tensor]], metadata: Optional[dict] = None) -> list[str]:
    """Write `shards` (one dict of tensors per file) into `directory` as described in the module
    docstring; returns the file names of the new weights (and index)."""
    remove_leftovers(directory)
    names = shard_names(len(shards))
    staged = []
    for name, shard in zip(names, shards):
        final = os.path.join(directory, name)
        tmp = _staged(final)
        save_file(shard, tmp, metadata=metadata)  # the umask's mode, as every other saved file
        fsync_file(tmp)
        staged.append((tmp, final))
    reached("save_pretrained:weights-staged")
    index = os.path.join(directory, SAFE_INDEX)
    if len(staged) == 1:
        os.replace(*staged[0])
        fsync_dir(directory)
        reached("save_pretrained:weights-replaced")
        if os.path.exists(index):  # an older sharded model: the index still wins until it is gone
            os.remove(index)
        new = set(names)
    else:
        weight_map = {}
        total = 0
        for (_, final), shard in zip(staged, shards):
            for key, tensor in shard.items():
                weight_map[key] = os.path.basename(final)
                total += tensor.numel() * tensor.element_size()
        if any(os.path.lexists(final) for _, final in staged):  # the old shards hold these names
            temporary = {os.path.basename(final): os.path.basename(tmp) for tmp, final in staged}
            _write_index(directory, {k: temporary[v] for k, v in weight_map.items()}, total)
            reached("save_pretrained:index-on-temporaries")
            for tmp, final in staged:
                if os.path.lexists(final):
                    os.remove(final)
                _link_or_copy(tmp, final)
            fsync_dir(directory)
            _write_index(directory, weight_map, total)
            for tmp, _ in staged:
                os.remove(tmp)
        else:
            for tmp, final in staged:
                os.rename(tmp, final)
            fsync_dir(directory)
            _write_index(directory, weight_map, total)
        reached("save_pretrained:index-written")
        new = set(names) | {SAFE_INDEX}
    for name in os.listdir(directory):
        if _WEIGHT_FILE.fullmatch(name) and name not in new:
            os.remove(os.path.join(directory, name))
    remove_leftovers(directory)  # a killed save's files the old index named are unreferenced now
    fsync_dir(directory)
    reached("save_pretrained:weights-committed")
    return sorted(new)


__all__ = ["write_weights", "remove_leftovers", "shard_names"]
