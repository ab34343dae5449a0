"""AutoTokenizer: Hugging Face tokenizers on the Rust `tokenizers` library, with transformers' API.

`AutoTokenizer.from_pretrained(folder_or_hub_id)` reads `tokenizer.json` with `tokenizers.Tokenizer`
and layers on it what transformers keeps in `tokenizer_config.json`: named special tokens (settable,
as in `tok.pad_token = tok.eos_token`), `model_max_length`, padding and truncation sides, the decode
clean-up flag and chat templates. The output matches `transformers.AutoTokenizer` (the fast
tokenizer) id for id; the parity tests in `tests/test_tokenizer_parity.py` prove it.

Design choices:
- The hot path is one call into Rust: `encode_batch_fast` with padding and truncation configured on
  the backend (no offsets are computed, no per-token Python loop), then one conversion to a tensor.
- The backend's padding/truncation settings are mutable state, so configuring and encoding happen
  under a lock: a generate thread decoding while a server thread encodes stays correct.
- `tokenizer.json`'s post-processor decides which special tokens are added (as transformers does
  when the file exists); `add_bos_token` flags in the config are ignored for the same reason.
- Bad input raises one sentence naming what is wrong and what to do.
"""

from __future__ import annotations

import copy
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as RustTokenizer

from staticformers.tokenization import assistant_masks as _masks
from staticformers.tokenization import chat_template as _chat
from staticformers.tokenization.files import (
    SPECIAL_TOKEN_NAMES,
    check_config_values,
    read_folder,
    resolve_folder,
    write_folder,
)

VERY_LARGE_INTEGER = int(1e30)  # transformers' "no limit" model_max_length
LARGE_INTEGER = int(1e20)
_PADDING = {
    True: "longest",
    "longest": "longest",
    "max_length": "max_length",
    False: None,
    "do_not_pad": None,
    None: None,
}
_TRUNCATION = {
    True: "longest_first",
    "longest_first": "longest_first",
    "only_first": "only_first",
    "only_second": "only_second",
    False: None,
    "do_not_truncate": None,
    None: None,
}
_FROM_PRETRAINED_OVERRIDES = {
    "padding_side",
    "truncation_side",
    "model_max_length",
    "clean_up_tokenization_spaces",
    "chat_template",
    "split_special_tokens",
    "model_input_names",
    "extra_special_tokens",
    "additional_special_tokens",
    *SPECIAL_TOKEN_NAMES,
}
_IGNORED_FROM_PRETRAINED = {
    "use_fast",
    "trust_remote_code",
    "_from_auto",
    "force_download",
    "proxies",
    "resume_download",
    "legacy",
}


class BatchEncoding(dict):
    """The mapping `__call__` returns (`input_ids`, `attention_mask`), with attribute access and `.to()`."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"BatchEncoding has no field {name!r}; it holds {sorted(self)}.") from None

    def __getstate__(self) -> dict:
        return dict(self)

    def __setstate__(self, state: dict) -> None:
        self.update(state)

    def to(self, device: Any, non_blocking: bool = False) -> "BatchEncoding":
        """Move every tensor to `device` (in place, like transformers); lists stay as they are."""
        import torch

        for key, value in self.items():
            if isinstance(value, torch.Tensor):
                self[key] = value.to(device, non_blocking=non_blocking)
        return self

    def convert_to_tensors(self, tensor_type: str | None) -> "BatchEncoding":
        for key, value in self.items():
            self[key] = _to_tensor(value, tensor_type, key)
        return self


def _to_tensor(rows: list, kind: str | None, name: str = "input_ids") -> Any:
    if kind is None:
        return rows
    if rows and isinstance(rows[0], list):
        lengths = {len(r) for r in rows}
        if len(lengths) > 1:
            raise ValueError(
                f"Cannot make one tensor of {name}: the sequences have different lengths "
                f"({min(lengths)} to {max(lengths)}); pass padding=True or padding='max_length'."
            )
    import numpy as np

    array = np.asarray(rows, dtype=np.int64)
    if kind == "np":
        return array
    import torch

    return torch.from_numpy(array)


def _plain(x: Any) -> Any:
    """Tensors, arrays and NumPy scalars (also inside lists) as Python ints and lists."""
    if hasattr(x, "tolist"):
        x = x.tolist()
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def _as_id_list(ids: Any) -> list:
    """Token ids from a tensor, an array, an int or a (nested) list of any of them, as Python lists."""
    ids = _plain(ids)
    if isinstance(ids, int):
        return [ids]
    if not isinstance(ids, list):
        raise TypeError(f"Token ids must be an int, a list of ints or a tensor, not {type(ids).__name__}.")
    return ids


def _check_ids(ids: list[int]) -> None:
    for i in ids:
        if not isinstance(i, int) or isinstance(i, bool) or i < 0:
            raise ValueError(
                f"Cannot decode token id {i!r}: ids must be non-negative ints (drop label padding such as -100 first)."
            )


def _apply_overrides(overrides: dict[str, Any], special: dict, extra: list, template: Any, config: dict) -> tuple:
    """`from_pretrained`'s keyword overrides, as transformers applies them: special tokens into `special`, other
    settings into `config` (both in place); returns the extra special tokens and the chat template."""
    for key, value in overrides.items():
        if key in _IGNORED_FROM_PRETRAINED:
            continue
        if key in SPECIAL_TOKEN_NAMES:
            special[key] = None if value is None else str(value)
        elif key in ("extra_special_tokens", "additional_special_tokens"):
            extra = [str(v) for v in value]
        elif key == "chat_template":
            template = value
        else:
            config[key] = value
    return extra, template


class FastTokenizer:
    """A Hugging Face tokenizer (tokenizer.json + tokenizer_config.json) with transformers' call API."""

    is_fast = True

    def __init__(
        self,
        backend: RustTokenizer,
        config: dict[str, Any] | None = None,
        *,
        special_tokens: Mapping[str, str | None] | None = None,
        extra_special_tokens: Sequence[str] = (),
        chat_template: str | dict | None = None,
        name_or_path: str = "",
    ) -> None:
        config = dict(config or {})
        check_config_values(config, f"{name_or_path or 'the tokenizer'}: tokenizer_config.json")
        self._backend = backend
        self._lock = threading.RLock()
        self._state: tuple | None = None  # the padding/truncation set on the backend now
        self._config = config
        self.name_or_path = name_or_path
        self._special: dict[str, str | None] = {name: None for name in SPECIAL_TOKEN_NAMES}
        for name, value in (special_tokens or {}).items():
            self._special[name] = None if value is None else str(value)
        self._extra_special = [str(t) for t in extra_special_tokens]
        max_len = config.get("model_max_length", config.get("max_len"))
        self.model_max_length = int(max_len) if max_len is not None else VERY_LARGE_INTEGER
        self.padding_side = config.get("padding_side", "right")
        self.truncation_side = config.get("truncation_side", "right")
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self._cleanup_for_bpe = bool(
            config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
        )
        self.split_special_tokens = bool(config.get("split_special_tokens", False))
        self.model_input_names = list(config.get("model_input_names") or ["input_ids", "attention_mask"])
        self.chat_template = chat_template
        backend.no_padding()
        backend.no_truncation()

    # ----- loading and saving -------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | Path,
        *,
        revision: str | None = None,
        cache_dir: str | None = None,
        local_files_only: bool = False,
        token: str | bool | None = None,
        subfolder: str = "",
        **overrides: Any,
    ) -> "FastTokenizer":
        """Load from a local folder or a Hub repo id (downloaded, or read from the cache when offline); with
        `gguf_file`, from that GGUF file's metadata (a file in the folder or repo, or a path)."""
        gguf_file = overrides.pop("gguf_file", None)
        unknown = set(overrides) - _FROM_PRETRAINED_OVERRIDES - _IGNORED_FROM_PRETRAINED
        if unknown:
            raise TypeError(
                f"AutoTokenizer.from_pretrained got unsupported argument(s) {sorted(unknown)}; it accepts "
                f"{sorted(_FROM_PRETRAINED_OVERRIDES)} as overrides of tokenizer_config.json."
            )
        if gguf_file is not None:
            return cls._from_gguf(
                name_or_path,
                gguf_file,
                overrides,
                revision=revision,
                cache_dir=cache_dir,
                local_files_only=local_files_only,
                token=token,
            )
        folder = resolve_folder(
            name_or_path,
            revision=revision,
            cache_dir=cache_dir,
            local_files_only=local_files_only,
            token=token,
            subfolder=subfolder,
        )
        files = read_folder(folder)
        try:
            backend = RustTokenizer.from_file(str(files.tokenizer_json))
        except Exception as err:  # the Rust loader raises plain Exception
            raise ValueError(
                f"{files.tokenizer_json} could not be read by the tokenizers library ({err}); re-download it or "
                "upgrade `tokenizers`."
            ) from err
        config = dict(files.config)
        special = {name: tok.content for name, tok in files.special_tokens.items()}
        # Padding/truncation saved inside tokenizer.json only give defaults (as in transformers); lengths
        # are decided per call.
        if backend.padding is not None:
            special.setdefault("pad_token", backend.padding.get("pad_token"))
            config.setdefault("padding_side", backend.padding.get("direction", "right"))
        if backend.truncation is not None:
            config.setdefault("truncation_side", backend.truncation.get("direction", "right"))
        extra = [tok.content for tok in files.extra_special_tokens]
        template = files.chat_template
        extra, template = _apply_overrides(overrides, special, extra, template, config)

        # As transformers does: added tokens listed only in the config, then named special tokens the
        # backend lacks, are added to the backend (existing ones keep their flags).
        known = {t.content for t in backend.get_added_tokens_decoder().values()}
        for _, spec in sorted(files.added_tokens_decoder.items()):
            if spec["content"] not in known:
                backend.add_tokens([AddedToken(**spec)])
                known.add(spec["content"])
        flags = {name: tok.flags for name, tok in files.special_tokens.items()}
        for name, content in special.items():
            if content is None or content in known:
                continue
            extra_flags = dict(flags.get(name) or {})
            extra_flags.update(special=True)
            extra_flags.setdefault("normalized", False)
            backend.add_special_tokens([AddedToken(content, **extra_flags)])
            known.add(content)
        missing_extra = [t for t in extra if t not in known]
        if missing_extra:
            backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing_extra])

        tok = cls(
            backend,
            config,
            special_tokens=special,
            extra_special_tokens=extra,
            chat_template=template,
            name_or_path=str(name_or_path),
        )
        tok._check_sides()
        return tok

    @classmethod
    def _from_gguf(
        cls, name_or_path: str | Path, gguf_file: str | os.PathLike, overrides: dict[str, Any], **hub: Any
    ) -> "FastTokenizer":
        """`from_pretrained(path, gguf_file=...)`: the tokenizer a GGUF file's metadata describes
        (`gguf_tokenizer.py`), with the call's overrides applied as for a folder."""
        from ..checkpoints.gguf_file import open_gguf
        from ..checkpoints.hub import resolve_file
        from .gguf_tokenizer import read_gguf_tokenizer

        path = os.fspath(gguf_file)
        if not os.path.isfile(path):
            path = resolve_file(os.fspath(name_or_path), path, **hub)
        parts = read_gguf_tokenizer(open_gguf(path))
        special, extra, template, config = (
            parts["special_tokens"],
            parts["extra_special_tokens"],
            parts["chat_template"],
            parts["config"],
        )
        extra, template = _apply_overrides(overrides, special, extra, template, config)
        backend = parts["backend"]
        known = {t.content for t in backend.get_added_tokens_decoder().values()} | set(backend.get_vocab())
        missing = [t for t in [*special.values(), *extra] if t is not None and t not in known]
        if missing:
            backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
        tok = cls(
            backend,
            config,
            special_tokens=special,
            extra_special_tokens=extra,
            chat_template=template,
            name_or_path=str(name_or_path),
        )
        tok._check_sides()
        return tok

    def save_pretrained(self, save_directory: str | Path, **_: Any) -> tuple[str, ...]:
        """Write tokenizer.json, tokenizer_config.json and chat_template.jinja, loadable by us and by transformers."""
        config = copy.deepcopy(self._config)
        for key in (
            "add_bos_token",
            "add_eos_token",
            "tokenizer_file",
            "name_or_path",
            "auto_map",
            "special_tokens_map_file",
            "additional_special_tokens",
        ):
            config.pop(key, None)
        config.update(
            model_max_length=self.model_max_length,
            padding_side=self.padding_side,
            truncation_side=self.truncation_side,
            clean_up_tokenization_spaces=self.clean_up_tokenization_spaces,
            split_special_tokens=self.split_special_tokens,
        )
        config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        for name in SPECIAL_TOKEN_NAMES:
            config[name] = self._special[name]
        config["extra_special_tokens"] = list(self._extra_special)
        config["added_tokens_decoder"] = {
            str(i): t.__getstate__() for i, t in sorted(self._backend.get_added_tokens_decoder().items())
        }
        with self._lock:
            self._backend.no_padding()
            self._backend.no_truncation()
            self._state = None
            data = self._backend.to_str(pretty=True)
        return tuple(write_folder(Path(save_directory), data, config, self.chat_template))

    # ----- special tokens -----------------------------------------------------------------------

    def _token_id(self, name: str) -> int | None:
        token = self._special[name]
        return None if token is None else self.convert_tokens_to_ids(token)

    def _set_token(self, name: str, value: Any) -> None:
        if value is not None and not isinstance(value, (str, AddedToken)):
            raise TypeError(
                f"{name} must be a token string (e.g. tok.{name} = tok.eos_token), not {type(value).__name__}."
            )
        self._special[name] = None if value is None else str(value)
        self._state = None

    def _set_token_id(self, name: str, value: int | None) -> None:
        if value is None:
            self._special[name] = None
        else:
            token = self._backend.id_to_token(int(value))
            if token is None:
                raise ValueError(f"{name}_id={value} is not in the vocabulary (size {len(self)}); pick an existing id.")
            self._special[name] = token
        self._state = None

    bos_token = property(lambda self: self._special["bos_token"], lambda self, v: self._set_token("bos_token", v))
    eos_token = property(lambda self: self._special["eos_token"], lambda self, v: self._set_token("eos_token", v))
    unk_token = property(lambda self: self._special["unk_token"], lambda self, v: self._set_token("unk_token", v))
    sep_token = property(lambda self: self._special["sep_token"], lambda self, v: self._set_token("sep_token", v))
    pad_token = property(lambda self: self._special["pad_token"], lambda self, v: self._set_token("pad_token", v))
    cls_token = property(lambda self: self._special["cls_token"], lambda self, v: self._set_token("cls_token", v))
    mask_token = property(lambda self: self._special["mask_token"], lambda self, v: self._set_token("mask_token", v))
    bos_token_id = property(
        lambda self: self._token_id("bos_token"), lambda self, v: self._set_token_id("bos_token", v)
    )
    eos_token_id = property(
        lambda self: self._token_id("eos_token"), lambda self, v: self._set_token_id("eos_token", v)
    )
    unk_token_id = property(
        lambda self: self._token_id("unk_token"), lambda self, v: self._set_token_id("unk_token", v)
    )
    sep_token_id = property(
        lambda self: self._token_id("sep_token"), lambda self, v: self._set_token_id("sep_token", v)
    )
    pad_token_id = property(
        lambda self: self._token_id("pad_token"), lambda self, v: self._set_token_id("pad_token", v)
    )
    cls_token_id = property(
        lambda self: self._token_id("cls_token"), lambda self, v: self._set_token_id("cls_token", v)
    )
    mask_token_id = property(
        lambda self: self._token_id("mask_token"), lambda self, v: self._set_token_id("mask_token", v)
    )

    @property
    def extra_special_tokens(self) -> list[str]:
        return list(self._extra_special)

    additional_special_tokens = extra_special_tokens

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens that are set, e.g. {'eos_token': '<|im_end|>'} (chat templates see these)."""
        return {name: value for name, value in self._special.items() if value is not None}

    @property
    def all_special_tokens(self) -> list[str]:
        seen: dict[str, None] = {}
        for token in [*self._special.values(), *self._extra_special]:
            if token is not None:
                seen.setdefault(token, None)
        return list(seen)

    @property
    def all_special_ids(self) -> list[int]:
        return self.convert_tokens_to_ids(self.all_special_tokens)

    def add_special_tokens(
        self, special_tokens_dict: Mapping[str, Any], replace_extra_special_tokens: bool = True
    ) -> int:
        """Add named (and `additional_special_tokens`) tokens to the vocabulary; returns how many were new.

        As in transformers, the extra special tokens given replace the earlier list unless
        `replace_extra_special_tokens=False` (the tokens stay in the vocabulary either way).
        """
        added = 0
        for key, value in special_tokens_dict.items():
            if key in ("additional_special_tokens", "extra_special_tokens"):
                values = [str(v) for v in value]
                added += self._backend.add_special_tokens(
                    [AddedToken(v, special=True, normalized=False) for v in values]
                )
                kept = [] if replace_extra_special_tokens else self._extra_special
                self._extra_special = list(dict.fromkeys([*kept, *values]))
            elif key in SPECIAL_TOKEN_NAMES:
                added += self._backend.add_special_tokens([AddedToken(str(value), special=True, normalized=False)])
                self._special[key] = str(value)
            else:
                raise ValueError(
                    f"{key!r} is not a special token name; use one of {list(SPECIAL_TOKEN_NAMES)} "
                    "or 'additional_special_tokens'."
                )
        self._state = None
        return added

    def add_tokens(
        self, new_tokens: str | AddedToken | Sequence[str | AddedToken], special_tokens: bool = False
    ) -> int:
        """Add plain (or special) tokens to the vocabulary; returns how many were new."""
        if isinstance(new_tokens, (str, AddedToken)):
            new_tokens = [new_tokens]
        if special_tokens:
            return self._backend.add_special_tokens(list(new_tokens))
        return self._backend.add_tokens(list(new_tokens))

    # ----- vocabulary -----------------------------------------------------------------------------

    @property
    def backend_tokenizer(self) -> RustTokenizer:
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Size of the base vocabulary, without added tokens (transformers' meaning)."""
        return self._backend.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        return self._backend.get_added_tokens_decoder()

    @property
    def added_tokens_encoder(self) -> dict[str, int]:
        return {t.content: i for i, t in sorted(self.added_tokens_decoder.items())}

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            index = self._backend.token_to_id(tokens)
            return index if index is not None else self._unk_id()
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def _unk_id(self) -> int | None:
        unk = self._special["unk_token"]
        return None if unk is None else self._backend.token_to_id(unk)

    def convert_ids_to_tokens(self, ids: int | Sequence[int], skip_special_tokens: bool = False) -> str | None | list:
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        ids = _as_id_list(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else ()
        return [self._backend.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        decoder = self._backend.decoder
        return decoder.decode(tokens) if decoder is not None else " ".join(tokens)

    def tokenize(self, text: str, pair: str | None = None, add_special_tokens: bool = False) -> list[str]:
        """The token strings of `text` (no special tokens added unless asked)."""
        with self._lock:
            self._configure(None, None, None, None, self.padding_side, self.split_special_tokens)
            enc = self._backend.encode(text, pair, add_special_tokens=add_special_tokens)
        return enc.tokens

    # ----- encoding -----------------------------------------------------------------------------

    def _check_sides(self) -> None:
        for name in ("padding_side", "truncation_side"):
            if getattr(self, name) not in ("left", "right"):
                raise ValueError(f"{name} must be 'left' or 'right', not {getattr(self, name)!r}.")

    def _configure(
        self,
        padding: str | None,
        length: int | None,
        multiple: int | None,
        truncation: str | None,
        side: str,
        split_special: bool,
        trunc_len: int | None = None,
    ) -> None:
        """Set padding/truncation on the backend if they differ from what is set (caller holds the lock)."""
        state = (
            padding,
            length,
            multiple,
            truncation,
            trunc_len,
            side,
            self.truncation_side,
            split_special,
            self._special["pad_token"],
            self.pad_token_id,
        )  # the id too: add_tokens can change it
        if state == self._state:
            return
        backend = self._backend
        if truncation is None:
            backend.no_truncation()
        else:
            backend.enable_truncation(trunc_len, stride=0, strategy=truncation, direction=self.truncation_side)
        if padding is None:
            backend.no_padding()
        else:
            backend.enable_padding(
                direction=side,
                pad_id=self.pad_token_id,
                pad_type_id=0,
                pad_token=self.pad_token,
                length=length if padding == "max_length" else None,
                pad_to_multiple_of=multiple,
            )
        backend.encode_special_tokens = split_special
        self._state = state

    def _strategies(
        self, padding: Any, truncation: Any, max_length: int | None, pad_to_multiple_of: int | None
    ) -> tuple[str | None, str | None, int | None]:
        """Resolve padding/truncation exactly as transformers' `_get_padding_truncation_strategies`."""
        if max_length is not None and padding is False and truncation is None:
            truncation = True  # transformers: max_length alone turns truncation on
        if isinstance(padding, str) or isinstance(padding, bool) or padding is None:
            if padding not in _PADDING:
                raise ValueError(f"padding={padding!r} is not valid; use False, True, 'longest' or 'max_length'.")
            pad = _PADDING[padding]
        else:
            raise ValueError(f"padding={padding!r} is not valid; use False, True, 'longest' or 'max_length'.")
        if not isinstance(truncation, (str, bool)) and truncation is not None:
            raise ValueError(
                f"truncation={truncation!r} is not valid; use True, False, 'longest_first', "
                "'only_first' or 'only_second'."
            )
        if truncation not in _TRUNCATION:
            raise ValueError(
                f"truncation={truncation!r} is not valid; use True, False, 'longest_first', "
                "'only_first' or 'only_second'."
            )
        trunc = _TRUNCATION[truncation]
        if max_length is not None and (
            not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 1
        ):
            raise ValueError(f"max_length must be a positive int, not {max_length!r}.")
        if pad_to_multiple_of is not None and (not isinstance(pad_to_multiple_of, int) or pad_to_multiple_of < 1):
            raise ValueError(f"pad_to_multiple_of must be a positive int, not {pad_to_multiple_of!r}.")
        if max_length is None:
            if pad == "max_length":
                if self.model_max_length > LARGE_INTEGER:
                    pad = None
                else:
                    max_length = self.model_max_length
            if trunc is not None:
                if self.model_max_length > LARGE_INTEGER:
                    trunc = None
                else:
                    max_length = self.model_max_length
        if pad is not None and (self.pad_token is None or self.pad_token_id is None):
            raise ValueError(
                "This tokenizer has no pad token, so it cannot pad; set one first, e.g. "
                "`tok.pad_token = tok.eos_token`."
            )
        if (
            trunc is not None
            and pad is not None
            and pad_to_multiple_of is not None
            and max_length is not None
            and max_length % pad_to_multiple_of != 0
        ):
            raise ValueError(
                f"Truncating to max_length={max_length} and padding to a multiple of "
                f"{pad_to_multiple_of} disagree; make max_length a multiple of pad_to_multiple_of."
            )
        return pad, trunc, max_length

    def __call__(
        self,
        text: str | Sequence[str] | Sequence[tuple[str, str]] | None = None,
        text_pair: str | Sequence[str] | None = None,
        *,
        add_special_tokens: bool = True,
        padding: bool | str = False,
        truncation: bool | str | None = None,
        max_length: int | None = None,
        pad_to_multiple_of: int | None = None,
        padding_side: str | None = None,
        return_tensors: str | None = None,
        return_attention_mask: bool | None = None,
        return_token_type_ids: bool | None = None,
        split_special_tokens: bool | None = None,
        verbose: bool = True,
        stride: int = 0,
        **unsupported: Any,
    ) -> BatchEncoding:
        """Encode one text, a batch, or pairs; pad and truncate like transformers; lists or tensors."""
        return self._encode(
            text,
            text_pair,
            add_special_tokens=add_special_tokens,
            padding=padding,
            truncation=truncation,
            max_length=max_length,
            pad_to_multiple_of=pad_to_multiple_of,
            padding_side=padding_side,
            return_tensors=return_tensors,
            return_attention_mask=return_attention_mask,
            return_token_type_ids=return_token_type_ids,
            split_special_tokens=split_special_tokens,
            stride=stride,
            **unsupported,
        )[0]

    def _encode(
        self,
        text: Any,
        text_pair: Any = None,
        *,
        add_special_tokens: bool = True,
        padding: bool | str = False,
        truncation: bool | str | None = None,
        max_length: int | None = None,
        pad_to_multiple_of: int | None = None,
        padding_side: str | None = None,
        return_tensors: str | None = None,
        return_attention_mask: bool | None = None,
        return_token_type_ids: bool | None = None,
        split_special_tokens: bool | None = None,
        stride: int = 0,
        with_offsets: bool = False,
        **unsupported: Any,
    ) -> tuple[BatchEncoding, list]:
        """`__call__`'s work; also returns the backend's encodings (with character offsets if asked)."""
        if unsupported:
            raise TypeError(
                f"The tokenizer call got unsupported argument(s) {sorted(unsupported)}; "
                "see the docstring of staticformers' tokenizer __call__ for what it accepts."
            )
        if stride:
            raise ValueError("stride (overflowing windows) is not supported; split long texts before tokenizing.")
        if return_tensors not in (None, "pt", "np"):
            raise ValueError(f"return_tensors={return_tensors!r} is not supported; use None, 'pt' or 'np'.")
        side = self.padding_side if padding_side is None else padding_side
        if side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', not {side!r}.")
        self._check_sides()
        batched, inputs = self._batch_inputs(text, text_pair)
        pad, trunc, max_length = self._strategies(padding, truncation, max_length, pad_to_multiple_of)
        split = self.split_special_tokens if split_special_tokens is None else bool(split_special_tokens)
        with self._lock:
            self._configure(pad, max_length, pad_to_multiple_of, trunc, side, split, max_length)
            try:
                encode = self._backend.encode_batch if with_offsets else self._backend.encode_batch_fast
                encodings = encode(inputs, add_special_tokens=add_special_tokens)
            except Exception as err:  # Rust errors (e.g. max_length shorter than the special tokens)
                raise ValueError(f"Tokenizing failed: {err}; check max_length and truncation.") from err
        out = BatchEncoding()
        out["input_ids"] = [e.ids for e in encodings]
        if return_token_type_ids:
            out["token_type_ids"] = [e.type_ids for e in encodings]
        if return_attention_mask or (return_attention_mask is None and "attention_mask" in self.model_input_names):
            out["attention_mask"] = [e.attention_mask for e in encodings]
        if return_tensors is not None:
            return out.convert_to_tensors(return_tensors), encodings
        if not batched:
            for key in out:
                out[key] = out[key][0]
        return out, encodings

    @staticmethod
    def _batch_inputs(text: Any, text_pair: Any) -> tuple[bool, list]:
        def bad(value: Any) -> ValueError:
            return ValueError(
                f"text must be a str, a list of str, or a list of (str, str) pairs, not {type(value).__name__}; "
                "convert the input to strings first."
            )

        if text is None:
            raise ValueError("No text given: pass a str or a list of str as the first argument.")
        if isinstance(text, str):
            if text_pair is not None and not isinstance(text_pair, str):
                raise bad(text_pair)
            return False, [text if text_pair is None else (text, text_pair)]
        if not isinstance(text, (list, tuple)):
            raise bad(text)
        if len(text) == 0:
            raise ValueError("Got an empty batch of texts; pass at least one string.")
        if text_pair is not None:
            if isinstance(text_pair, str) or not isinstance(text_pair, (list, tuple)):
                raise ValueError("For a batch of texts, text_pair must be a list of the same length, not a single str.")
            if len(text_pair) != len(text):
                raise ValueError(f"text has {len(text)} items but text_pair has {len(text_pair)}; give one pair each.")
            inputs = list(zip(text, text_pair))
        else:
            inputs = list(text)
        for item in inputs:
            if isinstance(item, str):
                continue
            if isinstance(item, (tuple, list)) and len(item) == 2 and all(isinstance(s, str) for s in item):
                continue
            raise bad(item)
        return True, inputs

    def encode(self, text: str, text_pair: str | None = None, add_special_tokens: bool = True, **kwargs: Any) -> Any:
        """The ids of one text (a list, or a [1, n] tensor with return_tensors='pt')."""
        if not isinstance(text, str):
            raise ValueError(f"encode takes one str (use the tokenizer call for batches), not {type(text).__name__}.")
        return self(text, text_pair, add_special_tokens=add_special_tokens, **kwargs)["input_ids"]

    # ----- decoding -----------------------------------------------------------------------------

    def _cleanup_active(self, clean_up_tokenization_spaces: bool | None) -> bool:
        cleanup = (
            self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None else clean_up_tokenization_spaces
        )
        if not cleanup:
            return False
        # transformers skips the (WordPiece-era) clean-up for BPE models: it would eat real spaces.
        return type(self._backend.model).__name__ != "BPE" or self._cleanup_for_bpe

    def _byte_fallback_ids(self) -> frozenset[int]:
        """Ids of `<0xHH>` byte tokens when the decoder has ByteFallback (else empty), for streaming.

        ByteFallback renders a run of byte tokens all at once: if the run is not valid UTF-8 every byte
        becomes U+FFFD, complete characters included, so a stream must not emit inside such a run.
        """
        cached = self.__dict__.get("_byte_ids_cache")
        if cached is None:
            decoder = self._backend.decoder
            cached = frozenset()
            if decoder is not None and b'"ByteFallback"' in decoder.__getstate__():
                ids = (self._backend.token_to_id(f"<0x{b:02X}>") for b in range(256))
                cached = frozenset(i for i in ids if i is not None)
            self.__dict__["_byte_ids_cache"] = cached
        return cached

    @staticmethod
    def clean_up_tokenization(text: str) -> str:
        return (
            text.replace(" .", ".")
            .replace(" ?", "?")
            .replace(" !", "!")
            .replace(" ,", ",")
            .replace(" ' ", "'")
            .replace(" n't", "n't")
            .replace(" 'm", "'m")
            .replace(" 's", "'s")
            .replace(" 've", "'ve")
            .replace(" 're", "'re")
        )

    def decode(
        self,
        token_ids: Any,
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
        **_: Any,
    ) -> str | list[str]:
        """Text of a sequence of ids; a batch (list of lists, 2-D tensor) gives a list of texts."""
        ids = _as_id_list(token_ids)
        if ids and isinstance(ids[0], list):
            return self.batch_decode(ids, skip_special_tokens, clean_up_tokenization_spaces)
        _check_ids(ids)
        text = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        if self._cleanup_active(clean_up_tokenization_spaces):
            text = self.clean_up_tokenization(text)
        return text

    def batch_decode(
        self,
        sequences: Any,
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
        **_: Any,
    ) -> list[str]:
        rows = _as_id_list(sequences)
        if rows and not isinstance(rows[0], list):
            rows = [rows]
        for row in rows:
            _check_ids(row)
        texts = self._backend.decode_batch(rows, skip_special_tokens=skip_special_tokens)
        if self._cleanup_active(clean_up_tokenization_spaces):
            texts = [self.clean_up_tokenization(t) for t in texts]
        return texts

    # ----- chat templates -----------------------------------------------------------------------

    def get_chat_template(self, chat_template: str | None = None, tools: list | None = None) -> str:
        """The template text to use: a named one from a dict of templates, the given one, or the default."""
        templates = self.chat_template
        if isinstance(templates, dict):
            if chat_template is not None and chat_template in templates:
                return templates[chat_template]
            if chat_template is None:
                if tools is not None and "tool_use" in templates:
                    return templates["tool_use"]
                if "default" in templates:
                    return templates["default"]
                raise ValueError(
                    f"This tokenizer has several chat templates and none is 'default'; pass "
                    f"chat_template= one of {sorted(templates)}."
                )
            return chat_template
        if chat_template is not None:
            return chat_template
        if templates is None:
            raise ValueError("This tokenizer has no chat template; set tok.chat_template or pass chat_template=.")
        return templates

    def apply_chat_template(
        self,
        conversation: Sequence[Mapping] | Sequence[Sequence[Mapping]],
        tools: list | None = None,
        documents: list | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        tokenize: bool = True,
        padding: bool | str = False,
        truncation: bool = False,
        max_length: int | None = None,
        return_tensors: str | None = None,
        return_dict: bool = False,
        tokenizer_kwargs: dict | None = None,
        return_assistant_tokens_mask: bool = False,
        **template_kwargs: Any,
    ) -> Any:
        """Render messages with the chat template (and tokenize them), with transformers' output.

        `return_assistant_tokens_mask=True` (with `return_dict=True`) adds `assistant_masks`: 1 on the
        tokens the template's `{% generation %}` blocks mark as the assistant's (see assistant_masks.py).
        """
        if return_assistant_tokens_mask and not (return_dict and tokenize):
            raise ValueError(
                "return_assistant_tokens_mask=True needs return_dict=True and tokenize=True: the masks "
                "come back next to input_ids in the returned dict."
            )
        if return_assistant_tokens_mask and continue_final_message:
            raise ValueError(
                "continue_final_message cannot be combined with return_assistant_tokens_mask=True: the "
                "last message is left open, so its assistant span has no end; drop one of them."
            )
        if template_kwargs.pop("sanitize_control_tokens", False):
            raise ValueError(
                "sanitize_control_tokens=True is not supported by staticformers' tokenizer; strip "
                "control tokens from user text before rendering."
            )
        template = self.get_chat_template(chat_template, tools)
        if return_assistant_tokens_mask and not _masks.has_generation_blocks(template):
            raise ValueError(_masks.no_generation_blocks_message())
        if not isinstance(conversation, (list, tuple)) or len(conversation) == 0:
            raise ValueError("The conversation must be a non-empty list of {'role': ..., 'content': ...} dicts.")
        batched = isinstance(conversation[0], (list, tuple)) or hasattr(conversation[0], "messages")
        conversations = conversation if batched else [conversation]
        cleaned = []
        for chat in conversations:
            chat = getattr(chat, "messages", chat)
            if not isinstance(chat, (list, tuple)) or len(chat) == 0:
                raise ValueError("Each conversation must be a non-empty list of message dicts.")
            for message in chat:
                if not isinstance(message, Mapping):
                    raise TypeError(f"Chat messages must be dicts with 'role' and 'content' keys, but got {message!r}.")
            cleaned.append([{k: v for k, v in m.items() if v is not None} for m in chat])
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message and add_generation_prompt cannot both be set: continue the last "
                "message, or start a new assistant turn, not both."
            )
        kwargs = {**self.special_tokens_map, **template_kwargs}
        rendered = _chat.render(
            template,
            cleaned,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            template_kwargs=kwargs,
            return_spans=return_assistant_tokens_mask,
        )
        if return_assistant_tokens_mask:
            rendered, spans = rendered
        if not tokenize:
            return rendered if batched else rendered[0]
        out, encodings = self._encode(
            rendered if batched else rendered[0],
            add_special_tokens=False,
            padding=padding,
            truncation=truncation,
            max_length=max_length,
            return_tensors=return_tensors,
            with_offsets=return_assistant_tokens_mask,
            **(tokenizer_kwargs or {}),
        )
        if return_assistant_tokens_mask:
            masks = _masks.token_masks(encodings, spans)
            out["assistant_masks"] = (
                _to_tensor(masks, return_tensors, "assistant_masks")
                if return_tensors
                else (masks if batched else masks[0])
            )
        return out if return_dict else out["input_ids"]

    # ----- misc ---------------------------------------------------------------------------------

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name_or_path={self.name_or_path!r}, vocab_size={self.vocab_size}, "
            f"len={len(self)}, model_max_length={self.model_max_length}, padding_side={self.padding_side!r}, "
            f"special_tokens={self.special_tokens_map})"
        )

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_backend"] = self._backend.to_str()
        state["_lock"] = None
        state["_state"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        state["_backend"] = RustTokenizer.from_str(state["_backend"])
        state["_lock"] = threading.RLock()
        self.__dict__.update(state)


class AutoTokenizer:
    """`AutoTokenizer.from_pretrained(path_or_hub_id)`: the one tokenizer class, built from tokenizer.json."""

    def __init__(self) -> None:
        raise TypeError("Use AutoTokenizer.from_pretrained(path_or_hub_id) to load a tokenizer.")

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | Path, *args: Any, **kwargs: Any) -> FastTokenizer:
        if args:
            raise TypeError(
                "AutoTokenizer.from_pretrained takes one positional argument (a folder or a Hub id); "
                "pass the others by name."
            )
        return FastTokenizer.from_pretrained(pretrained_model_name_or_path, **kwargs)


PreTrainedTokenizerFast = FastTokenizer

__all__ = ["AutoTokenizer", "BatchEncoding", "FastTokenizer", "PreTrainedTokenizerFast"]
