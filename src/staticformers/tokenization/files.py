"""Tokenizer files on disk and on the Hub: find them, read them, write them back.

A Hugging Face tokenizer folder holds `tokenizer.json` (the `tokenizers` pipeline: normaliser,
pre-tokeniser, model, post-processor, decoder, added tokens) and a few optional files that
transformers layers on top: `tokenizer_config.json` (special tokens, lengths, sides, chat template),
the legacy `special_tokens_map.json`, and chat templates in `chat_template.jinja` and
`chat_templates/<name>.jinja`. This module turns such a folder (or a Hub id, resolved through
`huggingface_hub`, offline from its cache when asked) into one `TokenizerFiles` record, and writes
the record back in the layout both staticformers and transformers load. It knows nothing about
encoding text.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..utils.contained_paths import check_name, file_in_folder
from ..checkpoints.hub import CheckpointNotFoundError, bad_id, missing_file, no_repo, not_a_folder, not_cached
from ..checkpoints.json_files import read_json_object

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "chat_templates"
_HUB_PATTERNS = [
    TOKENIZER_FILE,
    CONFIG_FILE,
    SPECIAL_TOKENS_MAP_FILE,
    CHAT_TEMPLATE_FILE,
    f"{CHAT_TEMPLATE_DIR}/*.jinja",
    "tokenizer.model",
    "*.tiktoken",
    "vocab.json",
    "merges.txt",
]

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")

# The named special tokens, in transformers' order (it matters for `all_special_tokens`).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclass
class SpecialToken:
    """A special token as the config gives it: its text and, when given as a dict, its AddedToken flags."""

    content: str
    flags: dict[str, Any] | None = None


@dataclass
class TokenizerFiles:
    """Everything read from a tokenizer folder, before any `tokenizers` object is built."""

    folder: Path
    tokenizer_json: Path
    config: dict[str, Any] = field(default_factory=dict)
    special_tokens: dict[str, SpecialToken] = field(default_factory=dict)
    extra_special_tokens: list[SpecialToken] = field(default_factory=list)
    added_tokens_decoder: dict[int, dict[str, Any]] = field(default_factory=dict)
    chat_template: str | dict[str, str] | None = None


def resolve_folder(
    name_or_path: str | os.PathLike,
    *,
    revision: str | None = None,
    cache_dir: str | None = None,
    local_files_only: bool = False,
    token: str | bool | None = None,
    subfolder: str = "",
) -> Path:
    """A local folder as it is, else a Hub repo id downloaded (or found in the cache) with `huggingface_hub`."""
    path = Path(name_or_path)
    if path.is_file() and path.name == TOKENIZER_FILE:
        return path.parent
    if subfolder:
        check_name(subfolder, "subfolder")
    if path.is_dir():
        folder = path / subfolder if subfolder else path
        if not folder.is_dir():
            raise missing_file(path, f"subfolder {subfolder!r}", "check the `subfolder` argument")
        return folder
    name = str(name_or_path)
    if not _REPO_ID.fullmatch(name) or ".." in name:
        raise not_a_folder(name)
    return _download(
        name,
        revision=revision,
        cache_dir=cache_dir,
        local_files_only=local_files_only,
        token=token,
        subfolder=subfolder,
    )


def _download(
    repo_id: str,
    *,
    revision: str | None,
    cache_dir: str | None,
    local_files_only: bool,
    token: str | bool | None,
    subfolder: str,
) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    patterns = [f"{subfolder}/{p}" if subfolder else p for p in _HUB_PATTERNS]
    try:
        snapshot = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache_dir,
            allow_patterns=patterns,
            local_files_only=local_files_only,
            token=token,
        )
    except HFValidationError as err:
        raise bad_id(repo_id, err) from None
    except LocalEntryNotFoundError:
        raise not_cached(repo_id, "The tokenizer") from None
    except GatedRepoError:
        raise CheckpointNotFoundError(
            f"{repo_id!r} is a gated repo: accept its licence on the Hub and log in (`hf auth login`) or pass token=."
        ) from None
    except RepositoryNotFoundError:
        raise no_repo(repo_id) from None
    except RevisionNotFoundError:
        raise missing_file(
            f"The Hub repo {repo_id!r}", f"revision {revision!r}", "check the `revision` argument"
        ) from None
    folder = Path(snapshot) / subfolder if subfolder else Path(snapshot)
    return folder


def _load_json(path: Path) -> dict[str, Any]:
    return read_json_object(path, "re-download or fix it")


def _as_token(value: Any, where: str) -> SpecialToken | None:
    if value is None:
        return None
    if isinstance(value, str):
        return SpecialToken(value)
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        flags = {k: v for k, v in value.items() if k in ("single_word", "lstrip", "rstrip", "normalized", "special")}
        return SpecialToken(value["content"], flags)
    raise ValueError(f"{where} should be a string or an AddedToken dict with a 'content' key, not {value!r}.")


def _missing_tokenizer_json(folder: Path) -> CheckpointNotFoundError:
    present = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    if "tokenizer.model" in present:
        what = "only a SentencePiece tokenizer.model"
    elif "vocab.json" in present or "merges.txt" in present:
        what = "only vocab.json/merges.txt"
    elif any(name.endswith(".tiktoken") for name in present):
        what = "only a tiktoken file"
    else:
        what = f"no tokenizer files (it holds: {', '.join(present[:8]) or 'nothing'})"
    return missing_file(
        folder,
        f"tokenizer.json ({what})",
        "staticformers reads tokenizer.json only, so convert it once with transformers "
        "(`AutoTokenizer.from_pretrained(path).save_pretrained(path)`) or point to a folder that has it",
    )


_BOOLEAN_KEYS = (
    "clean_up_tokenization_spaces",
    "split_special_tokens",
    "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
)


def check_config_values(config: dict[str, Any], source: str) -> None:
    """The values of tokenizer_config.json (or overrides) the tokenizer uses: one sentence per bad one."""
    length = config.get("model_max_length", config.get("max_len"))
    if length is not None and (
        isinstance(length, bool)
        or not isinstance(length, (int, float))
        or not length >= 1
        or length != length
        or length == float("inf")
    ):
        raise ValueError(f"{source}: model_max_length={length!r} must be a positive integer (omit it for no limit).")
    for key in ("padding_side", "truncation_side"):
        if key in config and config[key] not in ("left", "right"):
            raise ValueError(f"{source}: {key} must be 'left' or 'right', not {config[key]!r}.")
    for key in _BOOLEAN_KEYS:
        if config.get(key) is not None and not isinstance(config[key], bool):
            raise ValueError(f"{source}: {key}={config[key]!r} must be true or false (JSON booleans, without quotes).")
    names = config.get("model_input_names")
    if names is not None and (not isinstance(names, list) or not all(isinstance(n, str) for n in names)):
        raise ValueError(f"{source}: model_input_names={names!r} must be a list of strings.")


def _inside(folder: Path, name: str) -> Path:
    """`folder / name`, refused when it resolves outside the folder (a symbolic link out of it)."""
    return Path(file_in_folder(folder, name, str(folder)))


def read_folder(folder: Path) -> TokenizerFiles:
    """Read a resolved tokenizer folder into a `TokenizerFiles`; refuse one without tokenizer.json.

    Every file read must resolve inside the folder (`utils/contained_paths.py`): a symbolic link out of it is refused.
    """
    tokenizer_json = _inside(folder, TOKENIZER_FILE)
    if not tokenizer_json.is_file():
        raise _missing_tokenizer_json(folder)
    config_path = _inside(folder, CONFIG_FILE)
    config = _load_json(config_path) if config_path.is_file() else {}
    check_config_values(config, str(config_path))
    files = TokenizerFiles(folder=folder, tokenizer_json=tokenizer_json, config=config)

    # Special tokens: tokenizer_config.json first; the legacy special_tokens_map.json fills (and, as in
    # transformers, overrides) them when the config has no added_tokens_decoder.
    merged: dict[str, Any] = {k: config[k] for k in SPECIAL_TOKEN_NAMES if k in config}
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    if isinstance(extra, dict):  # named model-specific tokens, e.g. {"image_token": "<image>"}: the values
        extra = list(extra.values())
    map_path = _inside(folder, SPECIAL_TOKENS_MAP_FILE)
    if "added_tokens_decoder" not in config and map_path.is_file():
        special_map = _load_json(map_path)
        for key in SPECIAL_TOKEN_NAMES:
            if key in special_map:
                merged[key] = special_map[key]
        extra_map = special_map.get("extra_special_tokens") or special_map.get("additional_special_tokens") or []
        if isinstance(extra_map, list):
            seen = {(_as_token(t, "extra_special_tokens") or SpecialToken("")).content for t in extra}
            added = [
                t
                for t in extra_map
                if (_as_token(t, "additional_special_tokens") or SpecialToken("")).content not in seen
            ]
            extra = list(extra) + added
    for key, value in merged.items():
        token = _as_token(value, f"{key} in {folder.name}")
        if token is not None:
            files.special_tokens[key] = token
    files.extra_special_tokens = [t for t in (_as_token(v, "extra_special_tokens") for v in extra) if t is not None]
    decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        raise ValueError(f"{config_path}: added_tokens_decoder must be an object of token id -> token.")
    for idx, value in decoder.items():
        token = _as_token(value, f"added_tokens_decoder[{idx}]")
        if token is None or not str(idx).isdigit():
            raise ValueError(f"{config_path}: added_tokens_decoder[{idx!r}] must map a token id (digits) to a token.")
        files.added_tokens_decoder[int(idx)] = {"content": token.content, **(token.flags or {})}

    # Chat templates: separate .jinja files win over the config's entry.
    template: Any = config.get("chat_template")
    if isinstance(template, list):
        if not all(
            isinstance(e, dict) and isinstance(e.get("name"), str) and isinstance(e.get("template"), str)
            for e in template
        ):
            raise ValueError(
                f'{config_path}: chat_template, as a list, must hold {{"name": ..., "template": ...}} '
                f"objects of strings."
            )
        template = {entry["name"]: entry["template"] for entry in template}
    elif template is not None and not isinstance(template, str):
        raise ValueError(f"{config_path}: chat_template must be a string (or a list of named templates).")
    templates: dict[str, str] = {}
    default_template = _inside(folder, CHAT_TEMPLATE_FILE)
    if default_template.is_file():
        templates["default"] = default_template.read_text(encoding="utf-8")
    if _inside(folder, CHAT_TEMPLATE_DIR).is_dir():
        for path in sorted((folder / CHAT_TEMPLATE_DIR).glob("*.jinja")):
            path = _inside(folder, f"{CHAT_TEMPLATE_DIR}/{path.name}")
            templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if templates:
        template = templates["default"] if list(templates) == ["default"] else templates
    files.chat_template = template
    return files


def write_folder(
    folder: Path, tokenizer_json: str, config: dict[str, Any], chat_template: str | dict | None
) -> list[str]:
    """Write tokenizer.json, tokenizer_config.json and the chat template(s) into `folder`; return the paths."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    path = folder / TOKENIZER_FILE
    path.write_text(tokenizer_json, encoding="utf-8")
    written.append(str(path))
    config = dict(config)
    config.pop("chat_template", None)
    if isinstance(chat_template, str):
        path = folder / CHAT_TEMPLATE_FILE
        path.write_text(chat_template, encoding="utf-8")
        written.append(str(path))
    elif isinstance(chat_template, dict):
        for name, template in chat_template.items():
            if name == "default":
                path = folder / CHAT_TEMPLATE_FILE
            else:
                if not name or "/" in name or "\\" in name or name.startswith("."):
                    raise ValueError(f"Chat template name {name!r} cannot be a file name; rename it.")
                (folder / CHAT_TEMPLATE_DIR).mkdir(exist_ok=True)
                path = folder / CHAT_TEMPLATE_DIR / f"{name}.jinja"
            path.write_text(template, encoding="utf-8")
            written.append(str(path))
    path = folder / CONFIG_FILE
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False, sort_keys=True) + "\n", encoding="utf-8")
    written.append(str(path))
    return written
