"""Training examples as Documents: the token ids (and labels) of one example, before rows are built.

`Document` is what every dataset format becomes (`data.py` turns Documents into fixed rows);
`TextEncoder` tokenises text with whatever tokenizer the user passed; `iter_examples` walks any
dataset kind. Conversational and prompt-completion examples become Documents in `chat_data.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch

IGNORE_INDEX = -100  # a label the loss skips


class ExampleError(ValueError):
    """A bad training example, in one sentence that names it; `index` is its position in the dataset and
    `dataset` the dataset it is in, so a caller that read the dataset from files can say which file and line."""

    def __init__(self, index: int, message: str):
        super().__init__(message)
        self.index = index
        self.dataset: Any = None


@dataclass
class Document:
    """One tokenised example: `input_ids` and, when the dataset gave them, `labels` (same length)."""

    input_ids: list
    labels: Optional[list] = None


def as_list(x: Any) -> list:
    if isinstance(x, torch.Tensor):
        return x.reshape(-1).tolist()
    if hasattr(x, "tolist"):  # numpy
        return list(x.tolist())
    return list(x)


def iter_examples(dataset: Any) -> Iterator[Any]:
    """Rows of any dataset kind: a dict of columns, a sequence (list, torch or `datasets` dataset) or an iterable."""
    if isinstance(dataset, dict):
        columns = list(dataset)
        if not columns:
            return
        for values in zip(*(dataset[c] for c in columns)):
            yield dict(zip(columns, values))
        return
    if hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
        for i in range(len(dataset)):
            yield dataset[i]
        return
    yield from dataset


class TextEncoder:
    """Text -> token ids with whatever tokenizer the user passed (`processing_class`).

    Accepts staticformers' or transformers' tokenizers (callable, returning `input_ids`), a
    `tokenizers.Tokenizer` (`encode_batch`), or any object with `encode(text) -> ids`. An EOS token
    is appended to every document when the tokenizer has one, as TRL does, so a model learns to stop.
    """

    def __init__(self, tokenizer: Any, add_eos: bool = True):
        if tokenizer is None:
            raise ValueError(
                "The dataset has text but no tokenizer was given: pass processing_class=tokenizer to Trainer."
            )
        self.tokenizer = tokenizer
        self.eos_token_id = _token_id(tokenizer, "eos") if add_eos else None

    def encode_batch(self, texts: Sequence[str]) -> list[list]:
        tok = self.tokenizer
        try:
            from tokenizers import Tokenizer
        except ImportError:  # pragma: no cover - tokenizers is a dependency
            Tokenizer = ()
        if isinstance(tok, Tokenizer):
            ids = [enc.ids for enc in tok.encode_batch(list(texts))]
        elif callable(tok):
            out = tok(list(texts))
            ids = [as_list(x) for x in out["input_ids"]]
        elif hasattr(tok, "encode"):
            ids = [_encoded_ids(tok.encode(t)) for t in texts]
        else:
            raise TypeError(f"processing_class {type(tok).__name__} cannot tokenise text: pass a tokenizer.")
        if self.eos_token_id is not None:
            ids = [x if (x and x[-1] == self.eos_token_id) else x + [self.eos_token_id] for x in ids]
        return ids


def _encoded_ids(encoded: Any) -> list:
    return list(encoded.ids) if hasattr(encoded, "ids") else as_list(encoded)


def _token_id(tokenizer: Any, name: str) -> Optional[int]:
    value = getattr(tokenizer, f"{name}_token_id", None)
    if isinstance(value, int):
        return value
    return None


def pad_token_id_of(tokenizer: Any) -> int:
    """The id written into padding positions (its value never matters: padding has no labels)."""
    for name in ("pad", "eos"):
        value = _token_id(tokenizer, name) if tokenizer is not None else None
        if value is not None:
            return value
    return 0


__all__ = ["Document", "TextEncoder", "iter_examples", "pad_token_id_of", "IGNORE_INDEX"]
