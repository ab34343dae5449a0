"""Parity of staticformers' tokenizer with transformers' fast tokenizer, loaded from the same folders.

Four tokenizers trained in-test (see tokenizer_fixtures.py) stand for Qwen (byte-level BPE, ChatML),
Llama 3 (byte-level BPE, BOS from a TemplateProcessing post-processor, no pad token), Mistral /
Llama 2 (Metaspace BPE with byte fallback) and a SentencePiece Unigram with decode clean-up.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from staticformers import AutoTokenizer
from tokenizer_fixtures import HARD_STRINGS, build_all

transformers = pytest.importorskip("transformers")
NAMES = ["qwen", "llama3", "mistral", "unigram"]
SPECIAL_IN_TEXT = "<|im_start|>user\nhi<|im_end|> <s>x</s> <think>a</think><|eot_id|> <|im_sta <extra>"
BATCH = ["short", "a much longer sentence with café and 你好 😀", "", "tabs\tand\r\nCRLF", SPECIAL_IN_TEXT]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return build_all(tmp_path_factory.mktemp("toks"))


@pytest.fixture(scope="module")
def pairs(folders):
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in NAMES:
            ref = transformers.AutoTokenizer.from_pretrained(folders[name])
            ours = AutoTokenizer.from_pretrained(folders[name])
            if ref.pad_token is None:  # padding needs one; set it the way users do
                ref.pad_token = ref.eos_token
                ours.pad_token = ours.eos_token
            out[name] = (ours, ref)
    return out


def _same(a, b):
    """Equal outputs: dict keys and values, tensors compared by value and dtype."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
        return
    if isinstance(a, dict):
        assert set(a) == set(b), (set(a), set(b))
        for key in a:
            _same(a[key], b[key])
        return
    assert a == b


@pytest.mark.parametrize("name", NAMES)
def test_vocab_and_special_tokens(pairs, name):
    ours, ref = pairs[name]
    assert len(ours) == len(ref)
    assert ours.vocab_size == ref.vocab_size
    assert ours.all_special_ids == ref.all_special_ids
    assert ours.all_special_tokens == ref.all_special_tokens
    assert ours.special_tokens_map == ref.special_tokens_map
    for attr in (
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "unk_token_id",
        "model_max_length",
        "padding_side",
        "truncation_side",
    ):
        assert getattr(ours, attr) == getattr(ref, attr), attr
    assert ours.get_vocab() == ref.get_vocab()
    tokens = ref.convert_ids_to_tokens(list(range(len(ref))))
    assert ours.convert_ids_to_tokens(list(range(len(ours)))) == tokens
    assert ours.convert_tokens_to_ids(tokens) == ref.convert_tokens_to_ids(tokens)
    assert ours.convert_tokens_to_ids("not-a-token-xyz") == ref.convert_tokens_to_ids("not-a-token-xyz")
    assert ours.convert_ids_to_tokens(5) == ref.convert_ids_to_tokens(5)
    ids = ours(SPECIAL_IN_TEXT)["input_ids"]
    assert ours.convert_ids_to_tokens(ids, skip_special_tokens=True) == ref.convert_ids_to_tokens(
        ids, skip_special_tokens=True
    )


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_hard_strings(pairs, name, add_special_tokens):
    ours, ref = pairs[name]
    for text in HARD_STRINGS + [SPECIAL_IN_TEXT]:
        _same(
            dict(ours(text, add_special_tokens=add_special_tokens)),
            dict(ref(text, add_special_tokens=add_special_tokens)),
        )
        assert ours.encode(text, add_special_tokens=add_special_tokens) == ref.encode(
            text, add_special_tokens=add_special_tokens
        )
        assert ours.tokenize(text) == ref.tokenize(text)
    _same(
        dict(ours(HARD_STRINGS, add_special_tokens=add_special_tokens)),
        dict(ref(HARD_STRINGS, add_special_tokens=add_special_tokens)),
    )


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize(
    "padding,max_length,multiple",
    [
        (True, None, None),
        ("longest", None, 8),
        ("max_length", 48, None),
        ("max_length", 7, None),
        (False, 5, None),
    ],
)
def test_padding_and_truncation(pairs, name, side, padding, max_length, multiple):
    ours, ref = pairs[name]
    ours.padding_side = ref.padding_side = side
    kwargs = dict(padding=padding, max_length=max_length, pad_to_multiple_of=multiple)
    if max_length is not None:
        kwargs["truncation"] = True
    for tensors in (None, "pt"):
        if tensors and padding is False:
            continue
        _same(dict(ours(BATCH, return_tensors=tensors, **kwargs)), dict(ref(BATCH, return_tensors=tensors, **kwargs)))
    _same(dict(ours(BATCH[1], **kwargs)), dict(ref(BATCH[1], **kwargs)))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("truncation_side", ["left", "right"])
def test_truncation_strategies_and_pairs(pairs, name, truncation_side):
    ours, ref = pairs[name]
    ours.truncation_side = ref.truncation_side = truncation_side
    first = ["a fairly long first sentence with words", "short"]
    second = ["tiny", "a fairly long second sentence, with more words than the first"]
    for strategy in (True, "longest_first", "only_first", "only_second"):
        for max_length in (9, 12):
            try:
                expected = ref(first, second, truncation=strategy, max_length=max_length)
            except Exception:
                with pytest.raises(ValueError):
                    ours(first, second, truncation=strategy, max_length=max_length)
                continue
            _same(dict(ours(first, second, truncation=strategy, max_length=max_length)), dict(expected))
    _same(dict(ours(list(zip(first, second)), padding=True)), dict(ref(list(zip(first, second)), padding=True)))
    _same(dict(ours("one text", "its pair")), dict(ref("one text", "its pair")))
    # model_max_length decides when truncation=True has no max_length (64 for the unigram fixture).
    long = HARD_STRINGS[-1]
    _same(dict(ours(long, truncation=True)), dict(ref(long, truncation=True)))
    ours.truncation_side = ref.truncation_side = "right"


@pytest.mark.parametrize("name", NAMES)
def test_return_options(pairs, name):
    ours, ref = pairs[name]
    ours.padding_side = ref.padding_side = "left"
    for kwargs in (
        dict(return_attention_mask=False, padding=True),
        dict(padding=True, padding_side="right"),
        dict(padding=True, return_tensors="np"),
    ):
        a, b = ours(BATCH, **kwargs), ref(BATCH, **kwargs)
        assert set(a) == set(b)
        for key in a:
            assert [list(map(int, r)) for r in a[key]] == [list(map(int, r)) for r in b[key]]
    enc = ours(BATCH, padding=True, return_tensors="pt")
    assert enc.input_ids is enc["input_ids"] and enc.to("cpu") is enc
    assert enc["input_ids"].dtype == torch.int64 and enc["attention_mask"].dtype == torch.int64
    assert (
        ours.encode("hello world", return_tensors="pt").tolist()
        == ref.encode("hello world", return_tensors="pt").tolist()
    )


@pytest.mark.parametrize("name", NAMES)
def test_decode(pairs, name):
    ours, ref = pairs[name]
    for text in HARD_STRINGS + [SPECIAL_IN_TEXT]:
        ids = ref(text)["input_ids"]
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
            assert ours.decode(torch.tensor(ids, dtype=torch.long), skip_special_tokens=skip) == ref.decode(
                ids, skip_special_tokens=skip
            )
        for cleanup in (False, True):
            assert ours.decode(ids, clean_up_tokenization_spaces=cleanup) == ref.decode(
                ids, clean_up_tokenization_spaces=cleanup
            )
    batch = ref(BATCH, padding=True, return_tensors="pt")["input_ids"]
    for skip in (False, True):
        assert ours.batch_decode(batch, skip_special_tokens=skip) == ref.batch_decode(batch, skip_special_tokens=skip)
        assert ours.decode(batch, skip_special_tokens=skip) == ref.decode(batch, skip_special_tokens=skip)
    assert ours.decode(7) == ref.decode(7)
    assert ours.decode([]) == ref.decode([])


def test_cleanup_changes_text_for_unigram_only(pairs):
    """The clean-up flag must matter (so the decode test above can fail): it does for Unigram, not for BPE."""
    ours, _ = pairs["unigram"]
    ids = ours("Don't stop , it 's fine .", add_special_tokens=False)["input_ids"]
    assert ours.decode(ids, clean_up_tokenization_spaces=True) != ours.decode(ids, clean_up_tokenization_spaces=False)
    llama, _ = pairs["llama3"]  # clean_up_tokenization_spaces=True in its config, ignored for BPE
    ids = llama("it 's fine .", add_special_tokens=False)["input_ids"]
    assert llama.decode(ids) == "it 's fine ."


def test_pad_token_settable(folders):
    ours = AutoTokenizer.from_pretrained(folders["llama3"])
    assert ours.pad_token is None and ours.pad_token_id is None
    ours.pad_token = ours.eos_token
    assert ours.pad_token_id == ours.eos_token_id
    enc = ours(["a", "a longer one"], padding=True)
    assert enc["input_ids"][0][-1] == ours.eos_token_id
    ours.pad_token_id = 3
    assert ours.pad_token == ours.convert_ids_to_tokens(3)
    assert ours(["a", "a longer one"], padding=True)["input_ids"][0][-1] == 3


def _fresh_pair(folder):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoTokenizer.from_pretrained(folder), transformers.AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("name", ["qwen", "mistral"])
def test_decode_takes_lists_of_tensors_and_numpy_ints(pairs, name):
    import numpy as np

    ours, ref = pairs[name]
    rows = ours(["hello world", "a b c d"], padding=True, return_tensors="pt")["input_ids"]
    as_tensors = [row[1:] for row in rows]  # the model-card pattern: out[len(inputs):] per row
    assert ours.batch_decode(as_tensors, skip_special_tokens=True) == ref.batch_decode(
        as_tensors, skip_special_tokens=True
    )
    ids = ours("hello world")["input_ids"]
    assert ours.decode([np.int64(i) for i in ids]) == ref.decode([np.int64(i) for i in ids])
    assert ours.decode([torch.tensor(i) for i in ids]) == ref.decode([torch.tensor(i) for i in ids])


def test_padding_follows_a_pad_token_added_later(folders):
    """The pad token first resolves to <unk>; once added, padding must use its new id."""
    ours, ref = _fresh_pair(folders["mistral"])
    batch = ["a b c", "x"]
    for tok in (ours, ref):
        tok.pad_token = "<newpad>"  # not in the vocabulary yet
        tok(batch, padding=True)
        tok.add_tokens(["<newpad>"], special_tokens=True)
    assert ours.pad_token_id == ref.pad_token_id
    assert ours(batch, padding=True)["input_ids"] == ref(batch, padding=True)["input_ids"]


def test_add_special_tokens_replaces_the_extra_list(folders):
    ours, ref = _fresh_pair(folders["llama3"])
    for tok in (ours, ref):
        tok.add_special_tokens({"additional_special_tokens": ["<a1>"]})
        tok.add_special_tokens({"additional_special_tokens": ["<a2>"]})
    assert ours.all_special_tokens == ref.all_special_tokens
    assert ours.convert_tokens_to_ids("<a1>") == ref.convert_tokens_to_ids("<a1>")  # still in the vocabulary


def test_named_extra_special_tokens_with_a_legacy_map(folders, tmp_path):
    """A dict of named extra tokens ({"image_token": ...}) plus special_tokens_map.json: the names are
    not tokens, the values are."""
    import json
    import shutil

    folder = tmp_path / "named"
    shutil.copytree(folders["qwen"], folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.pop("additional_special_tokens", None)
    cfg.pop("added_tokens_decoder", None)
    cfg["extra_special_tokens"] = {"image_token": "<|im_start|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    (folder / "special_tokens_map.json").write_text(json.dumps({"additional_special_tokens": ["<|im_end|>"]}))
    ours, ref = _fresh_pair(folder)
    assert len(ours) == len(ref)
    assert ours("image_token")["input_ids"] == ref("image_token")["input_ids"]
