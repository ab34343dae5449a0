"""`apply_chat_template(..., return_dict=True, return_assistant_tokens_mask=True)`: masks equal transformers'."""

from __future__ import annotations

import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from chat_fixtures import CONVERSATIONS, QWEN_TRAINING_TEMPLATE, TRAINING_TEMPLATES, WEATHER_TOOLS
from staticformers import AutoTokenizer
from tokenizer_fixtures import build_llama3, build_qwen

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("masks")
    out = {}
    for name, build in (("qwen", build_qwen), ("llama3", build_llama3)):
        folder = build(root / name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ours, ref = AutoTokenizer.from_pretrained(folder), transformers.AutoTokenizer.from_pretrained(folder)
        if ref.pad_token is None:
            ours.pad_token = ref.pad_token = ref.eos_token
        out[name] = (ours, ref)
    return out


def both(pair, conversation, **kw):
    ours, ref = pair
    args = dict(return_dict=True, return_assistant_tokens_mask=True, **kw)
    return ours.apply_chat_template(conversation, **args), ref.apply_chat_template(conversation, **args)


@pytest.mark.parametrize("tokenizer", ["qwen", "llama3"])
@pytest.mark.parametrize("template", sorted(TRAINING_TEMPLATES))
def test_masks_equal_transformers_one_conversation_at_a_time(pairs, tokenizer, template):
    marked = 0
    for chat in CONVERSATIONS:
        for tools in (None, WEATHER_TOOLS):
            ours, ref = both(pairs[tokenizer], chat, chat_template=TRAINING_TEMPLATES[template], tools=tools)
            assert ours["input_ids"] == ref["input_ids"]
            assert ours["assistant_masks"] == ref["assistant_masks"]
            assert len(ours["assistant_masks"]) == len(ours["input_ids"])
            marked += sum(ours["assistant_masks"])
    assert marked > 0  # the comparison above sees masks that are not all zeros


@pytest.mark.parametrize("side", ["right", "left"])
def test_masks_equal_transformers_batched_padded_and_as_tensors(pairs, side):
    ours_tok, ref_tok = pairs["qwen"]
    ours_tok.padding_side = ref_tok.padding_side = side
    try:
        for tensors in (None, "pt"):
            ours, ref = both(
                pairs["qwen"],
                CONVERSATIONS,
                chat_template=QWEN_TRAINING_TEMPLATE,
                tools=WEATHER_TOOLS,
                padding=True,
                return_tensors=tensors,
            )
            if tensors:
                assert torch.equal(ours["assistant_masks"], ref["assistant_masks"])
                assert torch.equal(ours["input_ids"], ref["input_ids"])
                assert ours["assistant_masks"].shape == ours["input_ids"].shape
            else:
                assert ours["assistant_masks"] == ref["assistant_masks"] and ours["input_ids"] == ref["input_ids"]
        one, one_ref = both(pairs["qwen"], CONVERSATIONS[2], chat_template=QWEN_TRAINING_TEMPLATE, return_tensors="pt")
        assert one["assistant_masks"].shape == (1, len(one["input_ids"][0]))
        assert torch.equal(one["assistant_masks"], one_ref["assistant_masks"])
    finally:
        ours_tok.padding_side = ref_tok.padding_side = "right"


def test_masks_equal_transformers_when_truncation_cuts_a_span(pairs):
    full, _ = both(pairs["qwen"], CONVERSATIONS[1], chat_template=QWEN_TRAINING_TEMPLATE)
    n = len(full["input_ids"])
    for max_length in range(8, n, 7):  # cuts before, inside and between the assistant's spans
        ours, ref = both(
            pairs["qwen"],
            CONVERSATIONS[1],
            chat_template=QWEN_TRAINING_TEMPLATE,
            truncation=True,
            max_length=max_length,
        )
        assert ours["assistant_masks"] == ref["assistant_masks"] and len(ours["input_ids"]) == max_length


def test_qwen3_training_masks_hold_exactly_the_assistant_turns(pairs):
    ours_tok, _ = pairs["qwen"]
    out = ours_tok.apply_chat_template(
        CONVERSATIONS[2],
        chat_template=QWEN_TRAINING_TEMPLATE,
        tools=WEATHER_TOOLS,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    marked = [t for t, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    assert ours_tok.decode(marked) == (
        '<think>\nI should call the tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<think>\n\n</think>\n\nIt is 21 °C in Paris.<|im_end|>\n"
    )


def test_spans_are_kept_apart_across_threads(pairs):
    ours_tok, _ = pairs["qwen"]

    def masks(chat):
        return ours_tok.apply_chat_template(
            chat, chat_template=QWEN_TRAINING_TEMPLATE, return_dict=True, return_assistant_tokens_mask=True
        )["assistant_masks"]

    expected = [masks(c) for c in CONVERSATIONS]
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(masks, CONVERSATIONS * 8)) == expected * 8
