"""Static-shape training data: every batch is exactly `[batch_size, max_length]`.

A dataset (a `datasets.Dataset`, a list of dicts, a dict of columns, or a torch dataset) with
`input_ids` (optionally `labels`), `text` (tokenised with the `processing_class`), or TRL's
conversational `messages` and `prompt`/`completion` examples (`chat_data.py`: the chat template,
assistant-only and completion-only labels) becomes a fixed table of rows once, before training, in
one of two modes (each document keeps its own labels in both):

- **padding** (`packing=False`): one document per row, right-padded to `max_length`; labels are
  -100 on padding. A document longer than `max_length` is split into `max_length` pieces
  (`long_documents="split"`) or cut (`"truncate"`). Right padding under causal attention needs no
  attention mask: real tokens never see the padding after them, and padding has no labels.
- **packing** (`packing=True`): documents are concatenated into full rows. `position_ids` restart at
  0 at every document, which the model reads as a document boundary (attention never crosses it),
  and the first label of each document is -100 so no token predicts the next document. Packed loss
  therefore equals unpacked loss. `packing_strategy="bfd"` (best-fit decreasing) keeps documents
  whole (splitting only those longer than a row); `"wrapped"` fills every row to the end, splitting
  documents at row ends (waste only in the last row).

`StaticBatchSampler` orders the rows (a seeded shuffle per epoch) and groups them into batches;
the distributed layer shards it by data-parallel rank (`rank`, `world_size`). A batch short of
rows (the last one, when not dropped) is filled with empty rows (labels all -100), so the shape
never changes. `RowTable.padding_waste` is the fraction of positions that hold no document token,
`RowTable.loss_token_share` the fraction whose token carries loss.
"""

from __future__ import annotations

import bisect
import logging
import math
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch

from ..backends.memory_check import check_fits
from .chat_data import ChatEncoder, is_chat_example
from .documents import IGNORE_INDEX, Document, ExampleError, TextEncoder, as_list, iter_examples, pad_token_id_of

logger = logging.getLogger("staticformers")

EMPTY_ROW = -1  # sampler index of a filler row (labels all -100)


# ---------------------------------------------------------------------------------------------
# documents
# ---------------------------------------------------------------------------------------------
def tokenize_dataset(
    dataset: Any,
    processing_class: Any = None,
    chunk: int = 1000,
    assistant_only_loss: bool = False,
    completion_only_loss: Optional[bool] = None,
) -> list[Document]:
    """Every example as a Document (`_tokenize_dataset`); a bad example's ExampleError names this dataset."""
    try:
        return _tokenize_dataset(dataset, processing_class, chunk, assistant_only_loss, completion_only_loss)
    except ExampleError as err:
        err.dataset = dataset
        raise


def _tokenize_dataset(
    dataset: Any, processing_class: Any, chunk: int, assistant_only_loss: bool, completion_only_loss: Optional[bool]
) -> list[Document]:
    """Every example as a Document; text is tokenised in chunks of `chunk` examples.

    Conversational (`messages`) and prompt-completion (`prompt`/`completion`) examples go through
    `chat_data.ChatEncoder`, which sets the labels that `assistant_only_loss` / `completion_only_loss` ask for.
    """
    docs: list[Document] = []
    pending: list[str] = []
    encoder: Optional[TextEncoder] = None
    chat = ChatEncoder(processing_class, assistant_only_loss, completion_only_loss)

    def flush() -> None:
        nonlocal encoder
        if pending:
            encoder = encoder or TextEncoder(processing_class)
            docs.extend(Document(ids) for ids in encoder.encode_batch(pending))
            pending.clear()

    for i, example in enumerate(iter_examples(dataset)):
        if isinstance(example, str):
            chat.check_plain(i, "text")
            pending.append(example)
        elif isinstance(example, dict) or hasattr(example, "keys"):
            if "input_ids" in example:
                chat.check_plain(i, "token ids")
                flush()
                ids = as_list(example["input_ids"])
                labels = as_list(example["labels"]) if example.get("labels") is not None else None
                if labels is not None and len(labels) != len(ids):
                    raise ExampleError(
                        i,
                        f"Example {i} has {len(ids)} input_ids but {len(labels)} labels: they must be the same length.",
                    )
                docs.append(Document(ids, labels))
            elif is_chat_example(example):
                flush()
                docs.append(chat.encode(example, i))
            elif "text" in example:
                chat.check_plain(i, "text")
                if not isinstance(example["text"], str):
                    kind = type(example["text"]).__name__
                    raise ExampleError(
                        i,
                        f"Example {i} has a 'text' that is {'an' if kind[0] in 'aeiou' else 'a'} "
                        f"{kind}, not a str: fix that example (or give token ids as 'input_ids').",
                    )
                pending.append(example["text"])
            else:
                raise ExampleError(
                    i,
                    f"Example {i} has none of 'input_ids', 'text', 'messages' or 'prompt'/'completion' "
                    f"(keys: {', '.join(map(str, example.keys()))}): give each example one of them.",
                )
        elif isinstance(example, (list, tuple, torch.Tensor)):
            chat.check_plain(i, "token ids")
            flush()
            docs.append(Document(as_list(example)))
        else:
            raise ExampleError(
                i,
                f"Example {i} is a {type(example).__name__}: give dicts with 'input_ids', 'text', "
                f"'messages' or 'prompt'/'completion', or strings.",
            )
        if len(pending) >= chunk:
            flush()
    flush()
    chat.finish()
    return [d for d in docs if len(d.input_ids) > 0]


# ---------------------------------------------------------------------------------------------
# rows
# ---------------------------------------------------------------------------------------------
@dataclass
class RowTable:
    """The fixed rows of one dataset: `[rows, max_length]` tensors, built once.

    `position_ids` is None in padding mode (the model's plain causal path); in packing mode it
    restarts at every document.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: Optional[torch.Tensor]
    real_tokens: int  # positions that hold a document token
    documents: int
    pad_token_id: int
    packed: bool

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def max_length(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def padding_waste(self) -> float:
        """Fraction of row positions holding padding instead of a document token."""
        total = self.input_ids.numel()
        return 0.0 if total == 0 else 1.0 - self.real_tokens / total

    @property
    def loss_tokens(self) -> int:
        """Tokens the loss is computed on (labels not -100 after the causal shift)."""
        return count_label_tokens(self.labels)

    @property
    def loss_token_share(self) -> float:
        """Fraction of row positions whose token carries loss: at most 1 - padding_waste, lower when labels
        are masked (assistant-only or completion-only loss, a document's first token)."""
        total = self.input_ids.numel()
        return 0.0 if total == 0 else self.loss_tokens / total

    def stats(self) -> dict:
        return {
            "rows": self.num_rows,
            "documents": self.documents,
            "max_length": self.max_length,
            "real_tokens": self.real_tokens,
            "padding_waste": round(self.padding_waste, 6),
            "loss_tokens": self.loss_tokens,
            "loss_token_share": round(self.loss_token_share, 6),
            "mode": "packing" if self.packed else "padding",
        }

    def batch(self, indices: Sequence[int]) -> dict:
        """Rows `indices` as a batch dict; EMPTY_ROW (-1) gives an empty row (padding, labels -100)."""
        idx = torch.tensor([max(i, 0) for i in indices], dtype=torch.long)
        out = {"input_ids": self.input_ids.index_select(0, idx), "labels": self.labels.index_select(0, idx)}
        if self.position_ids is not None:
            out["position_ids"] = self.position_ids.index_select(0, idx)
        empty = torch.tensor([i == EMPTY_ROW for i in indices])
        if bool(empty.any()):
            out["input_ids"][empty] = self.pad_token_id
            out["labels"][empty] = IGNORE_INDEX
            if "position_ids" in out:
                out["position_ids"][empty] = torch.arange(self.max_length)
        return out


def _labels_of(doc: Document) -> list:
    return list(doc.labels) if doc.labels is not None else list(doc.input_ids)


def _pieces(doc: Document, max_length: int, truncate: bool) -> list[Document]:
    n = len(doc.input_ids)
    if n <= max_length:
        return [doc]
    if truncate:
        return [Document(doc.input_ids[:max_length], doc.labels[:max_length] if doc.labels is not None else None)]
    return [
        Document(doc.input_ids[s : s + max_length], doc.labels[s : s + max_length] if doc.labels is not None else None)
        for s in range(0, n, max_length)
    ]


def pad_rows(
    docs: Sequence[Document], max_length: int, pad_token_id: int = 0, long_documents: str = "split"
) -> RowTable:
    """One document (or piece) per row, right-padded with labels -100."""
    pieces = [p for d in docs for p in _pieces(d, max_length, long_documents == "truncate")]
    n = len(pieces)
    check_fits(
        2 * n * max_length * 8,
        "cpu",
        f"The padded training rows ({n} x max_length={max_length})",
        "lower max_length, or use packing=True",
    )
    input_ids = torch.full((n, max_length), pad_token_id, dtype=torch.long)
    labels = torch.full((n, max_length), IGNORE_INDEX, dtype=torch.long)
    real = 0
    for r, piece in enumerate(pieces):
        k = len(piece.input_ids)
        input_ids[r, :k] = torch.tensor(piece.input_ids, dtype=torch.long)
        labels[r, :k] = torch.tensor(_labels_of(piece), dtype=torch.long)
        real += k
    return RowTable(input_ids, labels, None, real, len(docs), pad_token_id, packed=False)


def _bfd_bins(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing: item indices per bin, each bin's total <= capacity."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (space left, bin index)
    for i in order:
        need = lengths[i]
        at = bisect.bisect_left(free, (need, -1))
        if at == len(free):
            bins.append([i])
            left = capacity - need
            b = len(bins) - 1
        else:
            left, b = free.pop(at)
            bins[b].append(i)
            left -= need
        if left > 0:
            bisect.insort(free, (left, b))
    return bins


def pack_rows(docs: Sequence[Document], max_length: int, pad_token_id: int = 0, strategy: str = "bfd") -> RowTable:
    """Documents concatenated into rows, positions restarting at each document, first labels -100."""
    if strategy == "bfd":
        pieces = [p for d in docs for p in _pieces(d, max_length, truncate=False)]
        rows = [[pieces[i] for i in b] for b in _bfd_bins([len(p.input_ids) for p in pieces], max_length)]
    elif strategy == "wrapped":
        rows, current, space = [], [], max_length
        for doc in docs:
            ids, labels = list(doc.input_ids), _labels_of(doc)
            while ids:
                take = min(space, len(ids))
                current.append(Document(ids[:take], labels[:take]))
                ids, labels, space = ids[take:], labels[take:], space - take
                if space == 0:
                    rows.append(current)
                    current, space = [], max_length
        if current:
            rows.append(current)
    else:
        raise ValueError(f'packing_strategy={strategy!r} is not supported: use "bfd" or "wrapped".')
    n = len(rows)
    check_fits(
        3 * n * max_length * 8, "cpu", f"The packed training rows ({n} x max_length={max_length})", "lower max_length"
    )
    input_ids = torch.full((n, max_length), pad_token_id, dtype=torch.long)
    labels = torch.full((n, max_length), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.empty((n, max_length), dtype=torch.long)
    real = 0
    for r, row in enumerate(rows):
        at = 0
        for piece in row:
            k = len(piece.input_ids)
            input_ids[r, at : at + k] = torch.tensor(piece.input_ids, dtype=torch.long)
            lab = _labels_of(piece)
            lab[0] = IGNORE_INDEX  # the previous document's last token must not predict this one
            labels[r, at : at + k] = torch.tensor(lab, dtype=torch.long)
            position_ids[r, at : at + k] = torch.arange(k)
            at += k
        position_ids[r, at:] = torch.arange(max_length - at)  # the padding tail is a document of its own
        real += at
    return RowTable(input_ids, labels, position_ids, real, len(docs), pad_token_id, packed=True)


def build_rows(
    dataset: Any,
    processing_class: Any,
    max_length: int,
    packing: bool,
    packing_strategy: str = "bfd",
    long_documents: str = "split",
    assistant_only_loss: bool = False,
    completion_only_loss: Optional[bool] = None,
) -> RowTable:
    """A dataset as a RowTable (see the module docstring)."""
    if isinstance(dataset, RowTable):
        return dataset
    docs = tokenize_dataset(
        dataset, processing_class, assistant_only_loss=assistant_only_loss, completion_only_loss=completion_only_loss
    )
    if not docs:
        raise ValueError("The dataset holds no tokens: give it at least one non-empty example.")
    long = sum(len(d.input_ids) > max_length for d in docs)
    if long:
        if packing and packing_strategy == "wrapped":
            rule = "split at row ends"
        elif not packing and long_documents == "truncate":
            rule = "cut to their first max_length tokens"
        else:
            rule = "split into max_length pieces"
        logger.info(
            "%d of %d documents are longer than max_length=%d: %s (a piece never sees the one before it).",
            long,
            len(docs),
            max_length,
            rule,
        )
    pad = pad_token_id_of(processing_class)
    if packing:
        return pack_rows(docs, max_length, pad, packing_strategy)
    return pad_rows(docs, max_length, pad, long_documents)


# ---------------------------------------------------------------------------------------------
# batches
# ---------------------------------------------------------------------------------------------
class StaticBatchSampler:
    """Row indices per batch, always exactly `batch_size` of them (EMPTY_ROW fills a short last batch).

    The order is a shuffle seeded by `seed + epoch` (or the row order with `shuffle=False`), so a
    resumed run sees the same batches. For data parallelism each rank takes every `world_size`-th
    batch-sized slice of the epoch's order starting at `rank`; with `drop_last` an epoch holds only
    the batches that every rank can fill.
    """

    def __init__(
        self,
        num_rows: int,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        rank: int = 0,
        world_size: int = 1,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is outside world_size={world_size}.")
        self.num_rows, self.batch_size, self.shuffle, self.seed = num_rows, batch_size, shuffle, seed
        self.drop_last, self.rank, self.world_size = drop_last, rank, world_size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        per_step = self.batch_size * self.world_size
        if self.drop_last:
            return self.num_rows // per_step
        return math.ceil(self.num_rows / per_step)

    def order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_rows))
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_rows, generator=g).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        order = self.order()
        per_step = self.batch_size * self.world_size
        for b in range(len(self)):
            chunk = order[b * per_step : (b + 1) * per_step]
            mine = chunk[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
            yield mine + [EMPTY_ROW] * (self.batch_size - len(mine))


def count_label_tokens(labels: torch.Tensor) -> int:
    """Tokens that are predicted (a label that is not -100 after the causal shift), as transformers counts them."""
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


__all__ = [
    "Document",
    "RowTable",
    "StaticBatchSampler",
    "TextEncoder",
    "build_rows",
    "pad_rows",
    "pack_rows",
    "tokenize_dataset",
    "iter_examples",
    "count_label_tokens",
    "IGNORE_INDEX",
    "EMPTY_ROW",
]
