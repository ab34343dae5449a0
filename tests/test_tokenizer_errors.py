"""Loading from folders and the Hub cache, legacy files, and one clear error per kind of bad input."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest

from staticformers import AutoTokenizer
from staticformers.checkpoints.hub import CheckpointNotFoundError
from tokenizer_fixtures import build_llama3, build_qwen

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory):
    return build_qwen(tmp_path_factory.mktemp("err") / "qwen")


@pytest.fixture(scope="module")
def tok(qwen_folder):
    return AutoTokenizer.from_pretrained(qwen_folder)


def test_folder_without_tokenizer_json_is_refused(tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(b"\x00sentencepiece")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(
        CheckpointNotFoundError, match=r"has no tokenizer\.json \(only a SentencePiece tokenizer\.model\).*convert"
    ):
        AutoTokenizer.from_pretrained(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        AutoTokenizer.from_pretrained(empty)


def test_missing_path_and_bad_json(tmp_path, qwen_folder):
    with pytest.raises(CheckpointNotFoundError, match="is not a folder"):
        AutoTokenizer.from_pretrained(str(tmp_path / "nope" / "deeper"))
    broken = tmp_path / "broken"
    shutil.copytree(qwen_folder, broken)
    (broken / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        AutoTokenizer.from_pretrained(broken)
    (broken / "tokenizer_config.json").write_text("{}")
    (broken / "tokenizer.json").write_text('{"version": "1.0"}')
    with pytest.raises(ValueError, match="could not be read by the tokenizers library"):
        AutoTokenizer.from_pretrained(broken)


def test_hub_id_from_local_cache_offline(tmp_path, qwen_folder):
    """A Hub id resolves from the huggingface_hub cache layout with local_files_only, without network."""
    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny-qwen"
    commit = "0" * 40
    shutil.copytree(qwen_folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    ours = AutoTokenizer.from_pretrained("org/tiny-qwen", cache_dir=str(cache), local_files_only=True)
    assert ours("hello")["input_ids"] == AutoTokenizer.from_pretrained(qwen_folder)("hello")["input_ids"]
    with pytest.raises(CheckpointNotFoundError, match="not in the local Hub cache"):
        AutoTokenizer.from_pretrained("org/not-cached", cache_dir=str(cache), local_files_only=True)


def test_legacy_special_tokens_map(tmp_path):
    folder = build_llama3(tmp_path / "l3")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    for key in ("bos_token", "eos_token", "added_tokens_decoder"):
        config.pop(key)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "special_tokens_map.json").write_text(
        json.dumps(
            {
                "bos_token": {
                    "content": "<|begin_of_text|>",
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                },
                "eos_token": "<|end_of_text|>",
                "pad_token": "<|pad|>",
            }
        )
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = transformers.AutoTokenizer.from_pretrained(folder)
    ours = AutoTokenizer.from_pretrained(folder)
    assert ours.special_tokens_map == ref.special_tokens_map
    assert ours.pad_token_id == ref.pad_token_id == len(ours) - 1  # "<|pad|>" was added on load
    assert len(ours) == len(ref) and ours.all_special_ids == ref.all_special_ids
    assert ours(["a", "bb b"], padding=True)["input_ids"] == ref(["a", "bb b"], padding=True)["input_ids"]


def test_from_pretrained_overrides_and_unknown_kwargs(qwen_folder):
    ours = AutoTokenizer.from_pretrained(qwen_folder, padding_side="left", pad_token="<|im_end|>", use_fast=True)
    assert ours.padding_side == "left" and ours.pad_token == "<|im_end|>"
    with pytest.raises(TypeError, match="unsupported argument"):
        AutoTokenizer.from_pretrained(qwen_folder, paddin_side="left")
    with pytest.raises(ValueError, match="padding_side must be 'left' or 'right'"):
        AutoTokenizer.from_pretrained(qwen_folder, padding_side="middle")


def test_padding_without_pad_token(tmp_path):
    ours = AutoTokenizer.from_pretrained(build_llama3(tmp_path / "l3"))
    with pytest.raises(ValueError, match=r"no pad token.*tok\.pad_token = tok\.eos_token"):
        ours(["a", "bb"], padding=True)
    with pytest.raises(ValueError, match="no pad token"):
        ours("a", padding="max_length", max_length=8)
    assert ours(["a", "bb"])["input_ids"]  # no padding asked: fine


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda t: t(None), "No text given"),
        (lambda t: t(123), "text must be a str"),
        (lambda t: t(["ok", 5]), "text must be a str"),
        (lambda t: t([]), "empty batch"),
        (lambda t: t(["a", "b"], ["only one"]), "text has 2 items but text_pair has 1"),
        (lambda t: t(["a"], "pair"), "text_pair must be a list"),
        (lambda t: t("a", padding="maximum"), "padding='maximum' is not valid"),
        (lambda t: t("a", truncation="sometimes"), "truncation='sometimes' is not valid"),
        (lambda t: t("a", max_length=0), "max_length must be a positive int"),
        (lambda t: t("a", return_tensors="tf"), "return_tensors='tf' is not supported"),
        (lambda t: t(["a", "bb bb bb"], return_tensors="pt"), "different lengths .* pass padding=True"),
        (lambda t: t("a", padding_side="up"), "padding_side must be"),
        (lambda t: t("a", stride=2), "stride"),
        (lambda t: t(["a b c"], padding=True, truncation=True, max_length=10, pad_to_multiple_of=4), "multiple of"),
        (lambda t: t.encode(["a"]), "encode takes one str"),
        (lambda t: t.decode([1, -100]), "non-negative ints"),
        (lambda t: t.decode("abc"), "Token ids must be"),
        (lambda t: t.apply_chat_template([]), "non-empty list"),
        (lambda t: t.apply_chat_template(["hi"]), "must be dicts"),
        (lambda t: t.apply_chat_template([{"role": "user", "content": "x"}], tools=[print]), "JSON schema dict"),
        (lambda t: t.apply_chat_template([{"role": "user", "content": "x"}], chat_template="{% if %}"), "syntax error"),
        (
            lambda t: t.apply_chat_template([{"role": "user", "content": "x"}], return_assistant_tokens_mask=True),
            "needs return_dict=True and tokenize=True",
        ),
        (
            lambda t: t.apply_chat_template(
                [{"role": "user", "content": "x"}], return_assistant_tokens_mask=True, return_dict=True
            ),
            r"this one has no such blocks: pass chat_template=",
        ),
        (
            lambda t: t.apply_chat_template(
                [{"role": "assistant", "content": "x"}],
                return_assistant_tokens_mask=True,
                return_dict=True,
                continue_final_message=True,
            ),
            "cannot be combined",
        ),
        (
            lambda t: t.apply_chat_template([{"role": "user", "content": "x"}], sanitize_control_tokens=True),
            "sanitize_control_tokens=True is not supported",
        ),
        (lambda t: t.add_special_tokens({"foo_token": "x"}), "not a special token name"),
    ],
)
def test_bad_input_gets_one_clear_error(tok, call, match):
    with pytest.raises((ValueError, TypeError)) as info:
        call(tok)
    import re

    assert re.search(match, str(info.value)), str(info.value)


def test_unsupported_call_kwarg_and_no_template(tok, tmp_path):
    with pytest.raises(TypeError, match=r"unsupported argument\(s\) \['return_offsets_mapping'\]"):
        tok("a", return_offsets_mapping=True)
    folder = build_qwen(tmp_path / "q")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no chat template"):
        AutoTokenizer.from_pretrained(folder).apply_chat_template([{"role": "user", "content": "x"}])


def test_pickle_and_threads(tok):
    import pickle
    from concurrent.futures import ThreadPoolExecutor

    clone = pickle.loads(pickle.dumps(tok))
    assert clone("héllo 你好")["input_ids"] == tok("héllo 你好")["input_ids"]
    texts = [f"text number {i} " * (i % 7 + 1) for i in range(64)]
    expected_pad = tok(texts, padding=True)["input_ids"]
    expected_plain = tok(texts)["input_ids"]

    def work(i):
        return tok(texts, padding=True)["input_ids"] if i % 2 else tok(texts)["input_ids"]

    with ThreadPoolExecutor(4) as pool:
        for i, out in enumerate(pool.map(work, range(16))):
            assert out == (expected_pad if i % 2 else expected_plain)
