"""Where a checkpoint's files are: a local folder, or a Hub id resolved through `huggingface_hub`.

Every loader (config, weights, tokenizer, generation config) asks this module for a local path, so
offline use from the Hub cache (`local_files_only=True` or `HF_HUB_OFFLINE=1`) and the errors for a
missing file are the same everywhere.
"""

from __future__ import annotations

import os
from typing import Optional

from ..utils.contained_paths import check_name, file_in_folder


class CheckpointNotFoundError(FileNotFoundError):
    """A folder or Hub id that does not hold what was asked for (a model's files or a tokenizer's)."""


# The sentences every loader uses (model, tokenizer, generation config), so a missing folder, file or Hub
# repo reads the same whichever loader met it.
def not_a_folder(name_or_path) -> CheckpointNotFoundError:
    return CheckpointNotFoundError(
        f'{name_or_path} is not a folder: pass a checkpoint folder or a Hub id like "Qwen/Qwen3-0.6B".'
    )


def missing_file(folder, filename: str, why: str = "it is not a complete checkpoint") -> CheckpointNotFoundError:
    return CheckpointNotFoundError(f"{folder} has no {filename}: {why}.")


def not_cached(name: str, what: str) -> CheckpointNotFoundError:
    return CheckpointNotFoundError(
        f"{what} of {name!r} is not in the local Hub cache and the Hub cannot be reached: "
        f"download it once while online, or pass a local folder."
    )


def no_repo(name: str) -> CheckpointNotFoundError:
    return CheckpointNotFoundError(
        f"{name!r} is neither a local folder nor a Hub repo we can access: check the path or id "
        f"(and token; a gated repo needs its licence accepted on the Hub)."
    )


def bad_id(name: str, err: Exception) -> CheckpointNotFoundError:
    return CheckpointNotFoundError(f"{name!r} is neither a local folder nor a valid Hub id ({err}).")


def is_local(name_or_path: str) -> bool:
    return os.path.isdir(name_or_path)


def resolve_file(
    name_or_path: str,
    filename: str,
    *,
    revision: Optional[str] = None,
    cache_dir: Optional[str] = None,
    local_files_only: bool = False,
    token: Optional[str] = None,
    required: bool = True,
    listed_in: Optional[str] = None,
) -> Optional[str]:
    """A local path to `filename` in the folder or Hub repo; None when not `required` and absent.

    `filename` must resolve inside the folder (`contained.file_in_folder`: no absolute path, no `..`,
    no symbolic link out of it); `listed_in` names the file it was read from, for the refusal.
    """
    name_or_path = os.fspath(name_or_path)
    what = listed_in or name_or_path
    if is_local(name_or_path):
        path = file_in_folder(name_or_path, filename, what)
        if os.path.isfile(path):
            return path
        if required:
            raise missing_file(name_or_path, filename)
        return None
    if name_or_path.startswith((".", "/", "~")) or os.path.splitdrive(name_or_path)[0]:
        raise not_a_folder(name_or_path)
    check_name(filename, what)
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return hf_hub_download(
            name_or_path,
            filename,
            revision=revision,
            cache_dir=cache_dir,
            local_files_only=local_files_only,
            token=token,
        )
    except LocalEntryNotFoundError:
        if not required:
            return None
        raise not_cached(name_or_path, filename) from None
    except EntryNotFoundError:
        if required:
            raise CheckpointNotFoundError(f"The Hub repo {name_or_path!r} has no file {filename!r}.") from None
        return None
    except RepositoryNotFoundError:  # a gated repo's error is one of these
        raise no_repo(name_or_path) from None
    except ValueError as err:  # huggingface_hub rejects malformed ids with ValueError subclasses
        raise bad_id(name_or_path, err) from None
