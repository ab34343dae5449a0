"""Chat templates and save/load: same text and ids as transformers; what we save, both load alike."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from staticformers import AutoTokenizer
from tokenizer_fixtures import HARD_STRINGS, build_llama3, build_mistral, build_qwen, build_unigram

transformers = pytest.importorskip("transformers")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city, in <b>°C</b> & more",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "名前 😀"}},
                "required": ["city"],
            },
        },
    }
]
CHATS = [
    [{"role": "user", "content": "Hello! Café 你好 😀"}],
    [
        {"role": "system", "content": "You are terse.\tTabs\r\nCRLF"},
        {"role": "user", "content": "What is 2+2? <|im_end|> inside text"},
        {"role": "assistant", "content": "4", "reasoning_content": "\nadd them\n"},
        {"role": "user", "content": "And 3+3?"},
    ],
    [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": '{"temp": 21}'},
        {"role": "assistant", "content": "It is 21 °C."},
    ],
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    return {
        "qwen": build_qwen(root / "qwen"),
        "llama3": build_llama3(root / "llama3"),
        "mistral": build_mistral(root / "mistral"),
        "unigram": build_unigram(root / "unigram"),
    }


def _load(folder):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoTokenizer.from_pretrained(folder), transformers.AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("name", ["qwen", "llama3"])
@pytest.mark.parametrize("gen", [False, True])
def test_chat_template_text_and_ids(folders, name, gen):
    ours, ref = _load(folders[name])
    extra = {"date_string": "26 Jul 2024"} if name == "llama3" else {}
    for chat in CHATS:
        for tools in (None, TOOLS):
            for kw in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
                args = dict(tools=tools, add_generation_prompt=gen, **kw, **extra)
                text = ours.apply_chat_template(chat, tokenize=False, **args)
                assert text == ref.apply_chat_template(chat, tokenize=False, **args)
                ids = ours.apply_chat_template(chat, **args)
                assert ids == ref.apply_chat_template(chat, return_dict=False, **args)
                assert ids == ours(text, add_special_tokens=False)["input_ids"]
    # enable_thinking really reaches the template (so the loop above can fail)
    if name == "qwen":
        off = ours.apply_chat_template(CHATS[0], tokenize=False, add_generation_prompt=True, enable_thinking=False)
        on = ours.apply_chat_template(CHATS[0], tokenize=False, add_generation_prompt=True)
        assert off.endswith("<think>\n\n</think>\n\n") and not on.endswith("</think>\n\n")
        assert "&lt;" not in ours.apply_chat_template(CHATS[0], tools=TOOLS, tokenize=False)  # tojson keeps HTML


def test_chat_template_outputs_and_batches(folders):
    ours, ref = _load(folders["qwen"])
    out = ours.apply_chat_template(CHATS[1], add_generation_prompt=True, return_tensors="pt")
    expected = ref.apply_chat_template(CHATS[1], add_generation_prompt=True, return_tensors="pt", return_dict=False)
    assert torch.equal(out, expected)
    enc = ours.apply_chat_template(
        CHATS, add_generation_prompt=True, return_dict=True, padding=True, return_tensors="pt"
    )
    ref_enc = ref.apply_chat_template(
        CHATS, add_generation_prompt=True, return_dict=True, padding=True, return_tensors="pt"
    )
    assert torch.equal(enc["input_ids"], ref_enc["input_ids"])
    assert torch.equal(enc["attention_mask"], ref_enc["attention_mask"])
    assert ours.apply_chat_template(CHATS, tokenize=False) == ref.apply_chat_template(CHATS, tokenize=False)
    truncated = ours.apply_chat_template(CHATS[1], truncation=True, max_length=10)
    assert truncated == ref.apply_chat_template(CHATS[1], truncation=True, max_length=10, return_dict=False)
    assert len(truncated) == 10


def test_continue_final_message(folders):
    ours, ref = _load(folders["qwen"])
    chat = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi there, 你"}]
    text = ours.apply_chat_template(chat, tokenize=False, continue_final_message=True)
    assert text == ref.apply_chat_template(chat, tokenize=False, continue_final_message=True)
    assert text.endswith("Hi there, 你")
    with pytest.raises(ValueError, match="cannot both be set"):
        ours.apply_chat_template(chat, continue_final_message=True, add_generation_prompt=True)


def test_mistral_template_and_special_tokens_in_template(folders):
    ours, ref = _load(folders["mistral"])
    chat = [
        {"role": "user", "content": "hi 你好"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "again"},
    ]
    assert ours.apply_chat_template(chat, tokenize=False) == ref.apply_chat_template(chat, tokenize=False)
    assert ours.apply_chat_template(chat) == ref.apply_chat_template(chat, return_dict=False)


def test_template_helpers_and_sandbox(folders):
    ours, _ = _load(folders["qwen"])
    with pytest.raises(Exception, match="Unknown role: robot"):
        ours.apply_chat_template([{"role": "robot", "content": "x"}])
    stamp = ours.apply_chat_template(
        [{"role": "user", "content": "x"}], tokenize=False, chat_template="{{ strftime_now('%Y') }}"
    )
    assert stamp.isdigit() and len(stamp) == 4
    with pytest.raises(Exception):  # noqa: B017 (the sandbox refuses dunder access, by one error type or another)
        ours.apply_chat_template(
            [{"role": "user", "content": "x"}], tokenize=False, chat_template="{{ messages.__class__.__mro__ }}"
        )
    with pytest.raises(Exception):  # noqa: B017
        ours.apply_chat_template(
            [{"role": "user", "content": "x"}],
            tokenize=False,
            chat_template="{% set ns = namespace() %}{% set ns._x = 1 %}",
        )
    gen = ours.apply_chat_template(
        [{"role": "user", "content": "x"}],
        tokenize=False,
        chat_template="{% for m in messages %}{% generation %}{{ m.content }}"
        "{% endgeneration %}{% break %}{% endfor %}",
    )
    assert gen == "x"


def test_named_templates_list_in_config(tmp_path):
    folder = build_qwen(tmp_path / "q")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "D{{ messages[0].content }}"},
        {"name": "tool_use", "template": "T{{ tools | length }}"},
    ]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    ours, ref = _load(folder)
    chat = [{"role": "user", "content": "x"}]
    for kwargs in ({}, {"tools": TOOLS}, {"chat_template": "tool_use", "tools": []}):
        assert ours.apply_chat_template(chat, tokenize=False, **kwargs) == ref.apply_chat_template(
            chat, tokenize=False, **kwargs
        )
    assert ours.apply_chat_template(chat, tokenize=False, tools=TOOLS) == "T1"
    # a chat_template.jinja file wins over the config's templates
    (folder / "chat_template.jinja").write_text("J{{ messages | length }}")
    ours, ref = _load(folder)
    assert ours.apply_chat_template(chat, tokenize=False) == ref.apply_chat_template(chat, tokenize=False) == "J1"


@pytest.mark.parametrize("builder", [build_qwen, build_llama3, build_mistral, build_unigram])
def test_save_pretrained_round_trip(tmp_path, builder):
    source = builder(tmp_path / "src")
    ours, _ = _load(source)
    ours.pad_token = ours.pad_token or ours.eos_token
    ours.padding_side = "left"
    ours.model_max_length = 40
    ours.add_tokens(["<new_tok>"])
    saved = tmp_path / "saved"
    files = ours.save_pretrained(saved)
    assert (saved / "tokenizer.json").is_file() and any(str(f).endswith("tokenizer_config.json") for f in files)
    again, ref = _load(saved)
    batch = HARD_STRINGS[:8] + ["with <new_tok> inside", HARD_STRINGS[-1]]
    for tok in (again, ref):
        assert tok.padding_side == "left" and tok.model_max_length == 40 and tok.pad_token == ours.pad_token
        assert len(tok) == len(ours) and tok.all_special_ids == ours.all_special_ids
        out = tok(batch, padding=True, truncation=True, return_tensors="pt")
        expected = ours(batch, padding=True, truncation=True, return_tensors="pt")
        assert torch.equal(out["input_ids"], expected["input_ids"])
        assert torch.equal(out["attention_mask"], expected["attention_mask"])
        ids = expected["input_ids"][1].tolist()
        assert tok.decode(ids, skip_special_tokens=True) == ours.decode(ids, skip_special_tokens=True)
    if ours.chat_template is not None:
        assert (saved / "chat_template.jinja").read_text() == ours.chat_template
        chat = [{"role": "user", "content": "hi"}]
        assert again.apply_chat_template(chat, tokenize=False, date_string="1 Jan 2024") == ref.apply_chat_template(
            chat, tokenize=False, date_string="1 Jan 2024"
        )


def test_we_load_what_transformers_saves(tmp_path):
    _, ref = _load(build_qwen(tmp_path / "src"))
    ref.padding_side = "left"
    ref.save_pretrained(tmp_path / "hf")
    ours, ref = _load(tmp_path / "hf")
    assert ours.padding_side == ref.padding_side and ours.chat_template == ref.chat_template
    assert ours.special_tokens_map == ref.special_tokens_map and ours.all_special_ids == ref.all_special_ids
    enc = ours(HARD_STRINGS[:6], padding=True)
    assert enc["input_ids"] == ref(HARD_STRINGS[:6], padding=True)["input_ids"]


def test_padding_and_truncation_blocks_in_tokenizer_json(tmp_path):
    """A tokenizer.json saved with padding/truncation set gives defaults (side, pad token), not fixed lengths."""
    folder = build_llama3(tmp_path / "l3")
    data = json.loads((folder / "tokenizer.json").read_text())
    data["padding"] = {
        "strategy": "BatchLongest",
        "direction": "Left",
        "pad_to_multiple_of": None,
        "pad_id": 4,
        "pad_type_id": 0,
        "pad_token": "<|eot_id|>",
    }
    data["truncation"] = {"direction": "Left", "max_length": 5, "strategy": "LongestFirst", "stride": 0}
    (folder / "tokenizer.json").write_text(json.dumps(data))
    ours, ref = _load(folder)
    assert (
        (ours.padding_side, ours.truncation_side, ours.pad_token)
        == (ref.padding_side, ref.truncation_side, ref.pad_token)
        == ("left", "left", "<|eot_id|>")
    )
    for kwargs in ({}, {"padding": True}, {"padding": True, "truncation": True, "max_length": 6}):
        assert ours(HARD_STRINGS[:6], **kwargs)["input_ids"] == ref(HARD_STRINGS[:6], **kwargs)["input_ids"]
