"""Constrained decoding: a grammar per request, one packed token bitmask per batch.

Why a module of its own: a request may ask that its answer match a JSON schema, any JSON object, a
regex, one of a few strings or a grammar (vLLM's `structured_outputs`, OpenAI's `response_format`, a
forced tool call). That is decided token by token on the host by a grammar matcher (llguidance, chosen
over xgrammar in BENCHMARKS.md), and it reaches the device as data, never as a graph:

- `StructuredOutputs` says what to match (vLLM's `StructuredOutputsParams` fields: `json`, `regex`,
  `choice`, `grammar`, `json_object`); `GrammarCompiler.compile` turns it into a `Grammar` for one
  tokenizer and vocabulary, refusing a bad schema, regex or grammar in one sentence (`ValueError`).
  `GenerationRequest.structured_outputs` takes the compiled `Grammar`.
- `RowConstraints` holds one matcher per slot of the batch and a host bitmask `[slots, ceil(vocab/32)]`
  int32, all ones (-1) for a free row. Before a step chooses its tokens, the constrained rows' words are
  filled (in a worker thread started before the device step, so the host fills the mask while the device
  computes); `RowSampler.choose` applies the mask to the logits of every row, greedy ones included.
  After the step each constrained row's matcher advances by its token; a grammar that can take no more
  tokens ends its row with finish reason "stop".
- A grammar may wait for a token (`Grammar.after`, e.g. `</think>`): until the row generates it, the row
  is free (the reasoning is not constrained, the answer after it is).

llguidance is imported only when a request is constrained; without it, `GrammarCompiler` refuses in one
sentence.
"""

from __future__ import annotations

import json
import re
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

INSTALL = "pip install 'staticformers[structured]'"
COMPILED_KEPT = 64  # compiled grammars a compiler keeps by their text


@dataclass
class StructuredOutputs:
    """What a constrained answer must match: exactly one of `json` (a JSON schema, a dict or its text),
    `regex`, `choice` (a list of strings), `grammar` (EBNF: GBNF's `root ::= ...` or Lark's `start: ...`),
    `json_object=True` (any JSON object), or `lark` (a Lark grammar in llguidance's dialect, `%json`
    included: how forced tool calls are built). vLLM's `StructuredOutputsParams` names."""

    json: Optional[Any] = None
    regex: Optional[str] = None
    choice: Optional[list] = None
    grammar: Optional[str] = None
    json_object: bool = False
    lark: Optional[str] = None
    # compact JSON (", " and ": " between items, no free whitespace), as json.dumps writes it; True allows any
    whitespace: bool = False

    def text(self) -> str:
        """The constraint as the client wrote it (a schema or list as compact JSON): what its size is
        measured by, and what compiled grammars are cached by (`GrammarCompiler.compile`)."""
        kind = self.kind()
        value = getattr(self, kind)
        body = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, sort_keys=True)
        return f"{kind}:{int(self.whitespace)}:{body}"

    def kind(self) -> str:
        given = [k for k in ("json", "regex", "choice", "grammar", "lark") if getattr(self, k) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs must set exactly one of json, regex, choice, grammar, json_object "
                f"(it sets {', '.join(given) or 'none'})."
            )
        return given[0]


@dataclass(frozen=True)
class Grammar:
    """A compiled constraint for one vocabulary: `matcher()` starts a row's matcher. `after`: a token id the
    row must generate before the grammar applies (None: from the first token)."""

    compiler: "GrammarCompiler"
    text: str = field(repr=False)
    after: Optional[int] = None

    def matcher(self):
        return self.compiler.ll.LLMatcher(self.compiler.tokenizer, self.text, log_level=0)

    def waiting_for(self, token: Optional[int]) -> "Grammar":
        """The same grammar, applied only after the row generates `token` (None: from the start)."""
        return Grammar(self.compiler, self.text, token)


def _llguidance():
    try:
        import llguidance
        import llguidance.gbnf_to_lark
        import llguidance.torch
    except ImportError:
        raise ValueError(
            f"Constrained decoding needs the llguidance package, which is not installed: {INSTALL}."
        ) from None
    return llguidance


class GrammarCompiler:
    """Compiles `StructuredOutputs` for one tokenizer (its `tokenizer.json`, via `backend_tokenizer`) and a
    model vocabulary of `vocab_size` ids (ids the tokenizer lacks are never allowed). Build it once per
    tokenizer: `compiler_for` caches it."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int] = ()):
        self.ll = _llguidance()
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError("Constrained decoding needs a fast tokenizer (one read from tokenizer.json).")
        eos = [int(t) for t in eos_token_ids]
        if not eos and getattr(tokenizer, "eos_token_id", None) is not None:
            eos = [int(tokenizer.eos_token_id)]
        self.vocab_size = int(vocab_size)
        self.tokenizer = self.ll.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size, eos_token=eos or None)
        self._token_ids = {t: i for t, i in tokenizer.get_vocab().items()} if hasattr(tokenizer, "get_vocab") else {}
        # the added tokens' texts (`<think>`, `<tool_call>`, ...): where a constraint's text holds one, llguidance's
        # mask allows only the added token and its matcher then refuses it (the answer ends there), so such a
        # constraint is refused (`compile`)
        decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self.added_texts = tuple(sorted({getattr(t, "content", str(t)) for t in decoder.values()} - {""}))
        self._compiled: OrderedDict = OrderedDict()  # `StructuredOutputs.text()` -> Grammar, least recent first
        self._compiled_lock = threading.Lock()

    def token_id(self, text: str) -> Optional[int]:
        """The id of a token spelled `text` in the vocabulary (e.g. `</think>`), None if there is none."""
        return self._token_ids.get(text)

    def compile(self, spec: StructuredOutputs, param: Optional[str] = None) -> Grammar:
        """The grammar of `spec`; a bad schema, regex or grammar is a `ValueError` naming it (`param`, by
        default `structured_outputs.<kind>`) and the library's error. The last `COMPILED_KEPT` grammars are
        kept by their text (`StructuredOutputs.text`): a client repeating its constraint compiles it once."""
        key = spec.text()
        if spec.kind() != "lark":  # a forced tool call's grammar names added tokens on purpose, by their ids
            held = [t for t in self.added_texts if t in key]
            if held:
                raise ValueError(
                    f"{param or 'structured_outputs.' + spec.kind()} holds {held[0]!r}, the text of one "
                    f"of the model's added tokens, which a constrained answer cannot write (the mask "
                    f"offers only the added token, which the grammar then refuses): leave it out of the "
                    f"constraint."
                )
        with self._compiled_lock:
            grammar = self._compiled.get(key)
            if grammar is not None:
                self._compiled.move_to_end(key)
                return grammar
        grammar = self._compile(spec, param)
        with self._compiled_lock:
            self._compiled[key] = grammar
            while len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)
        return grammar

    def _compile(self, spec: StructuredOutputs, param: Optional[str]) -> Grammar:
        ll = self.ll.LLMatcher
        kind = spec.kind()
        param = param or f"structured_outputs.{kind}"
        options: dict[str, Any] = {"whitespace_flexible": bool(spec.whitespace)}
        if not spec.whitespace:
            options.update(item_separator=", ", key_separator=": ")
        try:
            if kind == "json":
                schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
                if not isinstance(schema, (dict, bool)):
                    raise ValueError("a JSON schema must be an object")
                text = ll.grammar_from_json_schema(schema, defaults=options)
            elif kind == "json_object":
                text = ll.grammar_from_json_schema({"type": "object"}, defaults=options)
            elif kind == "regex":
                if not isinstance(spec.regex, str) or not spec.regex:
                    raise ValueError("the regex must be a non-empty string")
                text = ll.grammar_from_regex(spec.regex)
            elif kind == "choice":
                if (
                    not isinstance(spec.choice, list)
                    or not spec.choice
                    or not all(isinstance(c, str) and c for c in spec.choice)
                ):
                    raise ValueError("choice must be a non-empty list of non-empty strings")
                text = ll.grammar_from_lark(choice_lark(spec.choice))
            elif kind == "grammar":
                if not isinstance(spec.grammar, str) or not spec.grammar.strip():
                    raise ValueError("the grammar must be a non-empty string")
                text = ll.grammar_from_lark(self.ll.gbnf_to_lark.any_to_lark(spec.grammar))
            else:
                text = ll.grammar_from_lark(spec.lark)
        except ValueError as err:
            raise ValueError(f"{param} is not valid: {_first_line(err)}.") from None
        except Exception as err:  # the GBNF converter's own errors
            raise ValueError(f"{param} is not valid: {_first_line(err)}.") from None
        error = ll.validate_grammar(text, self.tokenizer)
        if error:
            raise ValueError(f"{param} is not valid: {_first_line(error)}.")
        return Grammar(self, text)


def choice_lark(choices: list) -> str:
    """A Lark grammar matching exactly one of `choices`: one terminal (a lexeme llguidance compiles to one
    automaton), not a rule of alternatives, whose parser row llguidance caps at 2000 items when the first
    token is masked ("Current row has 4760 items"), after the grammar compiled without complaint."""
    return "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in choices)


def _first_line(err: Any) -> str:
    """The library's message on one line, without its source excerpts and carets."""
    lines = [line.strip() for line in str(err).splitlines()]
    kept = [line for line in lines if line and set(line) - {"^", " "} and not re.match(r"\d+ \|", line)]
    return " ".join(kept).rstrip(".") or type(err).__name__


_COMPILERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
_POOL: Optional[ThreadPoolExecutor] = None  # one worker thread fills the masks of every batch
MASK_TIME = {"seconds": 0.0, "steps": 0}  # host time filling masks in this process, and the steps that filled one


def compiler_for(tokenizer, vocab_size: int, eos_token_ids: Sequence[int] = ()) -> GrammarCompiler:
    """The tokenizer's `GrammarCompiler` for `vocab_size` (built once: reading a vocabulary takes a while)."""
    key = (int(vocab_size), tuple(int(t) for t in eos_token_ids))
    with _LOCK:
        try:
            per = _COMPILERS.setdefault(tokenizer, {})
        except TypeError:  # not weakly referable
            per = {}
        if key not in per:
            per[key] = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
        return per[key]


@dataclass
class _Row:
    grammar: Grammar
    matcher: Any
    eos: tuple  # the row's stop ids: allowed whenever its grammar accepts
    waiting: bool  # until the row generates `grammar.after`


class RowConstraints:
    """The matchers of one batch's constrained rows and their packed bitmask (see the module docstring)."""

    def __init__(self, slots: int, vocab_size: int):
        self.slots, self.vocab = int(slots), int(vocab_size)
        self.words = (self.vocab + 31) // 32
        self.rows: list[Optional[_Row]] = [None] * self.slots
        self.fill_seconds = 0.0  # host time spent filling masks (reported by benchmarks)
        self.fills = 0

    # ---- rows joining, leaving, moving -----------------------------------------------------------
    def set_row(self, slot: int, grammar: Optional[Grammar], eos: Sequence[int]) -> None:
        self.rows[slot] = (
            None if grammar is None else _Row(grammar, grammar.matcher(), tuple(eos), grammar.after is not None)
        )

    def clear_row(self, slot: int) -> None:
        self.rows[slot] = None

    def resize(self, slots: int, src: Sequence[int], dst: Sequence[int]) -> None:
        rows: list = [None] * slots
        for s, d in zip(src, dst):
            rows[d] = self.rows[s]
        self.rows, self.slots = rows, int(slots)

    def active(self, rows: Sequence[int]) -> bool:
        return any((row := self.rows[r]) is not None and not row.waiting for r in rows)

    # ---- the mask ------------------------------------------------------------------------------------
    def start(self, rows: Sequence[int]) -> Optional[Future]:
        """Begin filling the mask of `rows` in a worker thread (None when none is constrained now); `mask`
        collects it."""
        if not self.active(rows):
            return None
        global _POOL
        with _LOCK:
            if _POOL is None:
                _POOL = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        return _POOL.submit(self.fill, list(rows))

    @staticmethod
    def mask(pending: Optional[Future]) -> Optional[torch.Tensor]:
        return None if pending is None else pending.result()

    def fill(self, rows: Sequence[int]) -> torch.Tensor:
        """The packed allowed-token mask of `rows`, `[len(rows), ceil(vocab/32)]` int32 on the host: all ones
        for a free row; a constrained row's grammar decides, with its stop ids allowed when it accepts."""
        import llguidance.torch as lt

        began = time.perf_counter()

        mask = torch.full((len(rows), self.words), -1, dtype=torch.int32)
        for i, r in enumerate(rows):
            row = self.rows[r]
            if row is None or row.waiting:
                continue
            lt.fill_next_token_bitmask(row.matcher, mask, i)
            words = mask[i]
            for t in row.eos:  # the row's own stop ids, not the tokenizer's: allowed only once the grammar accepts
                if 0 <= t < self.vocab:
                    words[t >> 5] &= ~_bit(t & 31)
            if row.matcher.is_accepting():
                for t in row.eos:
                    if 0 <= t < self.vocab:
                        words[t >> 5] |= _bit(t & 31)
            if not bool(words.any()):  # nothing allowed (a broken grammar state): the row is ended by `advance`
                words.fill_(-1)
        spent = time.perf_counter() - began
        self.fill_seconds += spent
        self.fills += 1
        MASK_TIME["seconds"] += spent  # written by the one worker thread only
        MASK_TIME["steps"] += 1
        return mask

    def advance(self, slot: int, token: int) -> bool:
        """Feed the row's chosen token to its matcher; True when its grammar is complete (the row ends)."""
        row = self.rows[slot]
        if row is None:
            return False
        if row.waiting:
            row.waiting = token != row.grammar.after
            return False
        if token in row.eos:
            return True
        row.matcher.consume_token(int(token))
        return row.matcher.is_stopped() or row.matcher.is_error()


def _bit(k: int) -> int:
    """Bit `k` of an int32 word as a Python int that fits int32 (bit 31 is the sign)."""
    return (1 << k) if k < 31 else -(1 << 31)


_BITS: dict = {}  # device -> [256, 8] bool: the bits of each byte value, lowest first


def unpack(mask: torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:
    """`[n, ceil(vocab/32)]` int32 (on the host) -> `[n, vocab]` bool on `device`: bit `v & 31` of word `v >> 5`.
    The words cross as their bytes (little-endian: bit `k` of a word is bit `k & 7` of its byte `k >> 3`)
    and each byte becomes its 8 bits by a table lookup, cheaper than shifting every id's word."""
    table = _BITS.get(device)
    if table is None:
        table = _BITS[device] = ((torch.arange(256).view(-1, 1) >> torch.arange(8)) & 1).bool().to(device)
    as_bytes = mask.contiguous().view(torch.uint8).to(device)
    return table[as_bytes.long()].view(mask.shape[0], -1)[:, :vocab]


__all__ = ["MASK_TIME", "Grammar", "GrammarCompiler", "RowConstraints", "StructuredOutputs", "compiler_for", "unpack"]
