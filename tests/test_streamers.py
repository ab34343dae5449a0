"""Streaming detokenisation: never half a character, and the pieces join to the whole decode."""

from __future__ import annotations

import queue
import threading

import pytest
import torch

from staticformers import AutoTokenizer, TextIteratorStreamer, TextStreamer
from staticformers.generation.streamers import IncrementalDecoder
from tokenizer_fixtures import HARD_STRINGS, build_all

MULTIBYTE = [
    "你好，世界！这是一个测试。",
    "😀🎉👍🏽 family: 👨‍👩‍👧‍👦 ok",
    "Café naïve 日本語 مرحبا e\u0301 😀\n\nnew line 你",
    "Don't stop , it 's fine . Isn't it ? ' a ' b",
    "<|im_start|>assistant\n<think>x</think> 你好<|im_end|> <s> </s>",
]


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    folders = build_all(tmp_path_factory.mktemp("stream"))
    return {name: AutoTokenizer.from_pretrained(path) for name, path in folders.items()}


def _stream(tok, ids, **kwargs):
    dec = IncrementalDecoder(tok, **kwargs)
    pieces = [dec.push([i]) for i in ids]
    pieces.append(dec.finish())
    return pieces


@pytest.mark.parametrize("name", ["qwen", "llama3", "mistral", "unigram"])
@pytest.mark.parametrize("skip", [False, True])
def test_every_prefix_matches_whole_decode(toks, name, skip):
    tok = toks[name]
    for text in MULTIBYTE + HARD_STRINGS[:-1]:
        ids = tok(text)["input_ids"]
        for end in range(len(ids) + 1):
            prefix = ids[:end]
            pieces = _stream(tok, prefix, skip_special_tokens=skip)
            assert "".join(pieces) == tok.decode(prefix, skip_special_tokens=skip), (text, end)
            expected_full = tok.decode(ids, skip_special_tokens=skip)
            streamed_before_finish = "".join(pieces[:-1])
            assert "\ufffd" not in streamed_before_finish or "\ufffd" in expected_full
            # never more than the final text: what was emitted is always a prefix of the whole decode
            assert expected_full.startswith(streamed_before_finish)


def test_byte_fallback_and_byte_level_hold_back_partial_characters(toks):
    for name in ("mistral", "qwen"):
        tok = toks[name]
        ids = tok("鑫", add_special_tokens=False)["input_ids"]
        assert len(ids) >= 2  # the character is split over byte tokens in both
        dec = IncrementalDecoder(tok)
        assert [dec.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
        last = dec.push([ids[-1]])
        assert last.endswith("鑫") or (name == "mistral" and last == "" and dec.finish().endswith("鑫"))


def test_windowed_decoding_stays_short(toks):
    """Each push decodes a window of a few ids, not the whole sequence."""
    tok = toks["qwen"]
    calls = []
    original = tok.decode

    class Spy:
        def decode(self, ids, **kw):
            calls.append(len(ids))
            return original(ids, **kw)

        _cleanup_active = tok._cleanup_active

    ids = tok(HARD_STRINGS[-1][:3000])["input_ids"]
    dec = IncrementalDecoder(Spy())
    for i in ids:
        dec.push([i])
    assert len(ids) > 500 and max(calls) < 16
    dec.finish()
    assert dec.text == tok.decode(ids)


def test_text_streamer_prints_prompt_and_generated(toks, capsys):
    tok = toks["mistral"]
    prompt = tok("Hello 你好", return_tensors="pt")["input_ids"]
    generated = tok("😀 world 日本", add_special_tokens=False)["input_ids"]
    streamer = TextStreamer(tok, skip_special_tokens=True)
    streamer.put(prompt)
    for i in generated:
        streamer.put(torch.tensor([i]))
    streamer.end()
    out = capsys.readouterr().out
    assert out == tok.decode(prompt[0].tolist() + generated, skip_special_tokens=True) + "\n"


def test_text_streamer_skip_prompt_and_batch_guard(toks, capsys):
    tok = toks["qwen"]
    streamer = TextStreamer(tok, skip_prompt=True)
    streamer.put(torch.tensor([tok("the prompt")["input_ids"]]))
    generated = tok("answer: 你好 😀", add_special_tokens=False)["input_ids"]
    for i in generated:
        streamer.put(torch.tensor([[i]]))
    streamer.end()
    assert capsys.readouterr().out == tok.decode(generated) + "\n"
    with pytest.raises(ValueError, match="batch size 1"):
        streamer.put(torch.zeros(2, 3, dtype=torch.long))


def test_text_iterator_streamer_across_threads(toks):
    tok = toks["llama3"]
    prompt = tok("Question?", return_tensors="pt")["input_ids"]
    generated = tok("Answer with 你好 and 😀 and more words", add_special_tokens=False)["input_ids"]
    streamer = TextIteratorStreamer(tok, skip_prompt=True, timeout=10, skip_special_tokens=True)

    def fake_generate():
        streamer.put(prompt)
        for i in generated:
            streamer.put(torch.tensor([i]))
        streamer.end()

    thread = threading.Thread(target=fake_generate)
    thread.start()
    pieces = list(streamer)
    thread.join()
    assert "".join(pieces) == tok.decode(generated, skip_special_tokens=True)
    assert all(p and "\ufffd" not in p for p in pieces)
    idle = TextIteratorStreamer(tok, timeout=0.05)
    with pytest.raises(queue.Empty):
        next(idle)
