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
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"})
    )
    ours = AutoTokenizer.from_pretrained(tmp_path)
    ours.chat_template = demo.TEMPLATE
    table = build_rows(rows, ours, 96, False, assistant_only_loss=True)
    for r, row in enumerate(rows):
        kept = [t for t in table.labels[r].tolist() if t != IGNORE_INDEX]
        assert ours.decode(kept) == " " + row["messages"][1]["content"] + "<|endoftext|>"
    prompt = ours.apply_chat_template(
        [{"role": "user", "content": "What does x do?"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "Question: What does x do?\nAnswer:"


def test_answered_exactly_checks_every_answer_token_and_only_those(tmp_path):
    """The chat stage's evaluation: greedy decoding writes the answer exactly when the next-token argmax is the
    answer's own token at each of the assistant's positions (its end-of-text included), whatever the model
    predicts inside the question."""
    import types

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    demo = load_demo_chat()
    rows = demo.conversations()[0][:3] + demo.unseen_conversations()[:2]
    assert [r["messages"][0]["content"] for r in rows[3:]] == [
        demo.UNSEEN.format(s) for s in list(demo.conversations()[1])[:2]
    ]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(
        [m["content"] for r in rows for m in r["messages"]],
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=["<|endoftext|>"],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"})
    )
    ours = AutoTokenizer.from_pretrained(tmp_path)
    ours.chat_template = demo.TEMPLATE
    vocab = ours.vocab_size
    encoded = [
        ours.apply_chat_template(
            r["messages"], return_dict=True, return_assistant_tokens_mask=True, return_tensors="pt"
        )
        for r in rows
    ]

    class Model:
        """Next-token argmax = the row's true next token, except at the positions `wrong_at(ids, mask)` names."""

        device = torch.device("cpu")

        def __init__(self, wrong_at):
            self.wrong_at = wrong_at

        def __call__(self, input_ids):  # a right-padded batch of the rows
            out = []
            for row in input_ids:
                ids, mask = next(
                    (e["input_ids"][0], torch.as_tensor(e["assistant_masks"]).reshape(-1))
                    for e in encoded
                    if torch.equal(e["input_ids"][0], row[: e["input_ids"].shape[1]])
                )
                nxt = torch.cat([row[1:], row[:1]])
                for i in self.wrong_at(ids, mask):
                    nxt[i] = (nxt[i] + 1) % vocab
                out.append(torch.nn.functional.one_hot(nxt, vocab).float())
            return types.SimpleNamespace(logits=torch.stack(out))

    first_answer = lambda mask: int(mask.nonzero()[0]) - 1  # noqa: E731  the position that predicts the answer's first token
    last_answer = lambda mask: int(mask.nonzero()[-1]) - 1  # noqa: E731  the one that predicts its end-of-text
    assert demo.answered_exactly(Model(lambda ids, m: []), ours, rows) == [True] * 5
    assert demo.answered_exactly(Model(lambda ids, m: [0, 1, 2]), ours, rows) == [True] * 5  # inside the question
    assert demo.answered_exactly(Model(lambda ids, m: [first_answer(m)]), ours, rows) == [False] * 5
    assert demo.answered_exactly(Model(lambda ids, m: [last_answer(m)]), ours, rows) == [False] * 5
    assert demo.answered_exactly(Model(lambda ids, m: [last_answer(m) + 1]), ours, rows) == [True] * 5  # after it
