"""AutoTokenizer.from_pretrained(path, gguf_file=...): a `tokenizers` pipeline rebuilt from a GGUF file's metadata.

Why this exists: a GGUF has no tokenizer.json. It stores the vocabulary, merges, token types, special token
ids and chat template under GGUF's `tokenizer.ggml.*` keys. We build the pipeline transformers' GGUF
tokenizer builds from them (the oracle: its `integrations.gguf` tokenizer mapping), without
importing transformers:
- `gpt2` (byte-level BPE: GPT-2, SmolLM, Llama 3, Qwen): tokens respelled in the byte alphabet, the file's
  merges, a ByteLevel pre-tokenizer (behind the split regex the file's `tokenizer.ggml.pre` names, when we
  know it), a ByteLevel decoder;
- `llama` (SentencePiece-style BPE: Llama 2, Mistral): byte fallback, Metaspace ("first"), merges from the
  file or recovered from the scores, BOS added unless the file says otherwise. Two architectures' files get
  their own form, as transformers picks it by `general.architecture` (its `GGUF_SENTENCEPIECE_BUILDERS`):
  Gemma (`gemma`, `gemma2`, `gemma3`) has no prefix space (spaces become "▁" in a normalizer), tokens of
  spaces only are respelled with "▁", and merges are recovered in the order of the tokens (Gemma's scores
  do not follow it); Phi-3 (`phi3`) puts its prefix space in a normalizer (before every piece of text
  between special tokens, where Metaspace adds one before the first).
Tokens typed CONTROL become special added tokens, USER_DEFINED plain added ones; BOS/EOS follow
`add_bos_token` / `add_eos_token`. Any other tokenizer model is refused in one sentence.
"""

from __future__ import annotations

import os
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from ..checkpoints.gguf_file import GGUFError, GGUFFile

CONTROL, USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` -> the split regex its merges were learned with (others: GPT-2's ByteLevel regex)
SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
MODELS = ("gpt2", "llama")
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")
SPACE = "\u2581"  # SentencePiece's space
_SPECIAL_IDS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _merges(meta: dict, vocab: dict[str, int], from_scores: bool) -> list[tuple[str, str]]:
    """The file's merges; without them (SentencePiece files), the ones its vocabulary and scores imply."""
    merges = meta.get("tokenizer.ggml.merges")
    if merges is not None:
        return [tuple(m.split(" ", 1)) for m in merges]
    if not from_scores:
        return []
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(vocab)
    return _merges_in_order(vocab, zip(meta["tokenizer.ggml.tokens"], scores))


def _byte_level(meta: dict) -> Tokenizer:
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for index, token in enumerate(meta["tokenizer.ggml.tokens"]):
        spelled = token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8"))
        vocab.setdefault(spelled, index)
    tok = Tokenizer(
        BPE(
            vocab=vocab,
            merges=_merges(meta, vocab, False),
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = SPLITS.get(meta.get("tokenizer.ggml.pre", ""))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(meta: dict) -> Tokenizer:
    vocab: dict[str, int] = {}
    for index, token in enumerate(meta["tokenizer.ggml.tokens"]):
        vocab.setdefault(token, index)
    tok = Tokenizer(
        BPE(vocab=vocab, merges=_merges(meta, vocab, True), fuse_unk=True, byte_fallback=True, dropout=None)
    )
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(content=" ", left=1)]
    )
    return tok


def _merges_in_order(vocab: dict[str, int], scored) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, best score first (transformers' `generate_merges`); `scored`: the
    (token, score) pairs, in the file's order."""
    pieces = []
    for token, score in scored:
        local = [
            (token[:i], token[i:], score) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab
        ]
        pieces.extend(sorted(local, key=lambda x: (vocab[x[0]], vocab[x[1]])))
    pieces.sort(key=lambda x: (x[2], len(x[0]), len(x[1])), reverse=True)
    return [(a, b) for a, b, _ in pieces]


def _gemma(meta: dict) -> Tokenizer:
    """transformers' `gemma_tokenizer` (a `GemmaTokenizer`): the module docstring."""
    tokens = [SPACE * len(t) if " " in t and not t.strip() else t for t in meta["tokenizer.ggml.tokens"]]
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = meta.get("tokenizer.ggml.merges")
    merges = (
        [tuple(m.split(" ", 1)) for m in merges]
        if merges is not None
        else _merges_in_order(vocab, {token: -index for index, token in enumerate(tokens)}.items())
    )
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True, unk_token="<unk>", dropout=None, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok


def _phi3(meta: dict) -> Tokenizer:
    """transformers' `phi3_tokenizer`: SentencePiece with the prefix space from a normalizer."""
    tok = _sentencepiece(meta)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    tok.pre_tokenizer = None
    return tok


def _added_tokens(tok: Tokenizer, meta: dict, byte_level: bool) -> list[str]:
    """CONTROL tokens as special added tokens (in a byte-level vocabulary only those spelled in its alphabet:
    others are converter mislabels), USER_DEFINED ones as plain added tokens; returns the special ones."""
    tokens, types = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type") or []
    spelled = set(_byte_alphabet().values()) if byte_level else None
    control = [t for t, kind in zip(tokens, types) if kind == CONTROL and (spelled is None or set(t) <= spelled)]
    if control:
        tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    vocab = tok.get_vocab()
    user = [t for t, kind in zip(tokens, types) if kind == USER_DEFINED and t in vocab]
    if user:
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    return control


def read_gguf_tokenizer(f: GGUFFile) -> dict[str, Any]:
    """What `FastTokenizer` needs, from `f`'s metadata: `backend` (a `tokenizers.Tokenizer`), `config`
    (add_bos_token, add_eos_token), `special_tokens`, `extra_special_tokens`, `chat_template`."""
    meta = f.metadata
    model = meta.get("tokenizer.ggml.model")
    if not isinstance(meta.get("tokenizer.ggml.tokens"), list):
        raise GGUFError(
            f"{os.path.basename(f.path)} has no tokenizer.ggml.tokens: it carries no tokenizer; load the "
            f"tokenizer from the model's Hub repo instead."
        )
    if model not in MODELS:
        raise GGUFError(
            f"{os.path.basename(f.path)} states tokenizer model {model!r} (tokenizer.ggml.model), which "
            f"staticformers does not build from GGUF ({' and '.join(MODELS)} it does): load the tokenizer "
            f"from the model's Hub repo instead."
        )
    arch = meta.get("general.architecture")
    if model == "gpt2":
        backend = _byte_level(meta)
    elif arch in GEMMA_ARCHITECTURES:
        backend = _gemma(meta)
    else:
        backend = _phi3(meta) if arch == "phi3" else _sentencepiece(meta)
    control = _added_tokens(backend, meta, model == "gpt2")
    tokens = meta["tokenizer.ggml.tokens"]
    special: dict[str, Any] = {
        name: tokens[meta[f"tokenizer.ggml.{key}"]]
        if isinstance(meta.get(f"tokenizer.ggml.{key}"), int) and 0 <= meta[f"tokenizer.ggml.{key}"] < len(tokens)
        else None
        for name, key in _SPECIAL_IDS.items()
    }
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", model == "llama"))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    add_bos, add_eos = add_bos and special["bos_token"] is not None, add_eos and special["eos_token"] is not None
    single = " ".join(
        ([f"{special['bos_token']}:0"] if add_bos else [])
        + ["$A:0"]
        + ([f"{special['eos_token']}:0"] if add_eos else [])
    )
    pair = " ".join(
        [single]
        + ([f"{special['bos_token']}:1"] if add_bos else [])
        + ["$B:1"]
        + ([f"{special['eos_token']}:1"] if add_eos else [])
    )
    ids = [
        (special[n], backend.token_to_id(special[n]))
        for n, on in (("bos_token", add_bos), ("eos_token", add_eos))
        if on
    ]
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=list(dict.fromkeys(ids))
    )
    named = {v for v in special.values() if v is not None}
    return {
        "backend": backend,
        "config": {"add_bos_token": add_bos, "add_eos_token": add_eos},
        "special_tokens": special,
        "extra_special_tokens": [t for t in control if t not in named],
        "chat_template": meta.get("tokenizer.chat_template"),
    }


__all__ = ["read_gguf_tokenizer", "SPLITS", "MODELS"]
