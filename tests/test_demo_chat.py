"""The demo's chat stage (`examples/demo_chat.py`): its conversations, template and labels."""

import importlib.util
import json
import os

from staticformers import AutoTokenizer
from staticformers.training.data import IGNORE_INDEX, build_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_demo_chat():
    spec = importlib.util.spec_from_file_location("demo_chat", os.path.join(ROOT, "examples", "demo_chat.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_conversations_come_from_the_docs_and_only_answers_carry_loss(tmp_path):
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    demo = load_demo_chat()
    rows, answers = demo.conversations()
    assert len(answers) >= 10 and len(rows) == len(answers) * len(demo.ASKED)
    prose = " ".join(" ".join(t.split()) for t in topics.values())
    for subject, answer in answers.items():
        assert answer.endswith(".") and answer[:-1] in prose, (subject, answer)

    tok = Tokenizer(models.BPE())  # a tokenizer like the demo's: byte-level BPE, one special token
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    texts = [m["content"] for r in rows for m in r["messages"]]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>",
                                                                 "pad_token": "<|endoftext|>"}))
    ours = AutoTokenizer.from_pretrained(tmp_path)
    ours.chat_template = demo.TEMPLATE
    table = build_rows(rows, ours, 96, False, assistant_only_loss=True)
    for r, row in enumerate(rows):
        kept = [t for t in table.labels[r].tolist() if t != IGNORE_INDEX]
        assert ours.decode(kept) == " " + row["messages"][1]["content"] + "<|endoftext|>"
    prompt = ours.apply_chat_template([{"role": "user", "content": "What does x do?"}], tokenize=False,
                                      add_generation_prompt=True)
    assert prompt == "Question: What does x do?\nAnswer:"
