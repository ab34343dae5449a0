"""`staticformers train`: from a config (scratch) with .jsonl ids, then fine-tuning that checkpoint on .txt text."""

import importlib.util
import json
import os

import pytest

from staticformers.commands.cli import main
from staticformers.commands.train import read_documents


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_config(path):
    cfg = dict(
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
    )
    path.write_text(json.dumps(cfg))
    return str(path)


def test_train_from_scratch_then_fine_tune_text(tmp_path, capsys):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    ids = tmp_path / "ids.jsonl"
    ids.write_text(
        "".join(json.dumps({"input_ids": list(range(1 + i % 7, 5 + i % 7 + i % 5))}) + "\n" for i in range(40))
    )
    out = tmp_path / "scratch"
    rc = main(
        [
            "train",
            tiny_config(tmp_path / "config.json"),
            "--data",
            str(ids),
            "--output-dir",
            str(out),
            "--max-length",
            "32",
            "--max-steps",
            "3",
            "--batch-size",
            "4",
            "--packing",
            "--no-save",
            "--quiet",
            "--compile",
            "--backend",
            "eager",
        ]
    )
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["global_step"] == 3 and summary["train_graphs"] == 2 and summary["padding_waste"] < 0.1
    assert os.path.exists(out / "model.safetensors")
    assert os.path.exists(out / "loss_curve.png") or not importlib.util.find_spec("matplotlib")

    text = (
        "The for statement is used to iterate over the elements of a sequence.\n\nA class definition defines a class object.\n\n"
        * 10
    )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(
        [text],
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=["<eos>"],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "pad_token": "<eos>"}))
    (tmp_path / "corpus.txt").write_text(text)
    tuned = tmp_path / "tuned"
    rc = main(
        [
            "train",
            str(out),
            "--data",
            str(tmp_path / "corpus.txt"),
            "--eval-data",
            str(tmp_path / "corpus.txt"),
            "--output-dir",
            str(tuned),
            "--max-length",
            "24",
            "--max-steps",
            "2",
            "--batch-size",
            "4",
            "--save-steps",
            "1",
            "--save-total-limit",
            "1",
            "--quiet",
        ]
    )
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["eval_perplexity"] > 1 and os.listdir(tuned / "checkpoint-2")
    assert not os.path.exists(tuned / "checkpoint-1") and os.path.exists(tuned / "tokenizer.json")


def test_data_formats_and_refusals(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("one\ntwo\n\nthree\n")
    assert read_documents(str(tmp_path / "a.txt")) == ["one\ntwo", "three"]
    assert read_documents(str(tmp_path / "a.txt"), "line") == ["one", "two", "three"]
    (tmp_path / "b.jsonl").write_text('{"text": "x"}\n')
    assert read_documents(str(tmp_path)) == ["one\ntwo", "three", {"text": "x"}]
    (tmp_path / "bad.jsonl").write_text("{oops\n")
    with pytest.raises(ValueError, match="line 1 is not JSON"):
        read_documents(str(tmp_path / "bad.jsonl"))
    rc = main(["train", str(tmp_path / "nowhere"), "--data", str(tmp_path / "a.txt")])
    assert rc == 2 and "config.json" in capsys.readouterr().err


def test_train_on_conversations_with_assistant_only_loss_and_a_chat_template(tmp_path, capsys):
    from chat_fixtures import CONVERSATIONS, QWEN_TRAINING_TEMPLATE
    from tokenizer_fixtures import build_qwen

    from staticformers import AutoTokenizer

    folder = build_qwen(tmp_path / "tok")
    config = json.loads(open(tiny_config(tmp_path / "config.json")).read())
    (tmp_path / "config.json").write_text(json.dumps({**config, "vocab_size": 640}))
    rows = [{"messages": c} for c in CONVERSATIONS] + [
        {"prompt": [{"role": "user", "content": "Hi"}], "completion": [{"role": "assistant", "content": "Hello."}]}
    ]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows * 4))
    (tmp_path / "train.jinja").write_text(QWEN_TRAINING_TEMPLATE)
    out = tmp_path / "out"
    base = [
        "train",
        str(tmp_path / "config.json"),
        "--tokenizer",
        str(folder),
        "--data",
        str(tmp_path / "chats.jsonl"),
        "--output-dir",
        str(out),
        "--max-length",
        "64",
        "--max-steps",
        "2",
        "--batch-size",
        "4",
        "--no-save",
        "--quiet",
    ]
    rc = main(base + ["--assistant-only-loss", "--chat-template", str(tmp_path / "train.jinja"), "--packing"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["global_step"] == 2 and 0 < summary["loss_token_share"] < 1 - summary["padding_waste"] - 0.2
    assert AutoTokenizer.from_pretrained(out).chat_template == QWEN_TRAINING_TEMPLATE  # saved with the model
    full = main(base)  # the tokenizer's own template and the whole conversation: more tokens carry loss
    assert full == 0 and json.loads(capsys.readouterr().out.strip().splitlines()[-1])["loss_token_share"] > 0.5
    rc = main(base + ["--assistant-only-loss"])  # the fixture's own template has no {% generation %} blocks
    assert rc == 2 and "chat_template_path" in capsys.readouterr().err


def test_a_bad_data_row_is_named_by_its_file_and_line(tmp_path, capsys):
    from tokenizer_fixtures import build_qwen

    from staticformers.training.data import tokenize_dataset
    from staticformers.training.documents import ExampleError

    folder = build_qwen(tmp_path / "tok")
    with pytest.raises(
        ExampleError, match=r"^Example 1 has a 'text' that is an int, not a str: fix that example"
    ) as err:
        tokenize_dataset([{"text": "fine"}, {"text": 7}], None)
    assert err.value.index == 1
    config = json.loads(open(tiny_config(tmp_path / "config.json")).read())
    (tmp_path / "config.json").write_text(json.dumps({**config, "vocab_size": 640}))
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_text('{"text": "one"}\n\n{"text": "two"}\n')
    (data / "b.jsonl").write_text('{"text": "three"}\n{"text": 4}\n')  # the folder's 4th example, b.jsonl's line 2
    base = [
        "train",
        str(tmp_path / "config.json"),
        "--tokenizer",
        str(folder),
        "--output-dir",
        str(tmp_path / "out"),
        "--max-length",
        "16",
        "--max-steps",
        "1",
        "--batch-size",
        "2",
        "--no-save",
        "--quiet",
    ]
    assert read_documents(str(data)).origins == [
        f"{data / 'a.jsonl'} line 1",
        f"{data / 'a.jsonl'} line 3",
        f"{data / 'b.jsonl'} line 1",
        f"{data / 'b.jsonl'} line 2",
    ]
    assert main(base + ["--data", str(data)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"staticformers train: --data {data / 'b.jsonl'} line 2: this example has a 'text' that is an int, not a str: "
        f"fix that example (or give token ids as 'input_ids')."
    )
    (tmp_path / "chats.jsonl").write_text('{"text": "fine"}\n{"messages": "not a list"}\n')
    assert main(base + ["--data", str(data / "a.jsonl"), "--eval-data", str(tmp_path / "chats.jsonl")]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .startswith(
            f"staticformers train: --eval-data {tmp_path / 'chats.jsonl'} line 2: this example has 'messages' that are not"
        )
    )


def test_the_shipped_chat_sample_trains_and_lora_defaults_to_its_own_learning_rate(tmp_path, capsys):
    import sys

    from tokenizer_fixtures import build_qwen

    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
    sys.path.insert(0, examples)
    import demo_chat

    sample = os.path.join(examples, "chat_sample.jsonl")
    rows = read_documents(sample)
    expected, _ = demo_chat.conversations()  # the file is the demo's conversations
    assert [r["messages"][0] for r in rows] == [r["messages"][0] for r in expected]
    assert all([m["role"] for m in r["messages"]] == ["user", "assistant"] for r in rows)
    with open(os.path.join(examples, "qa_training.jinja"), encoding="utf-8") as f:
        assert f.read() == demo_chat.TEMPLATE and "{% generation %}" in demo_chat.TEMPLATE

    folder = build_qwen(tmp_path / "tok")
    config = json.loads(open(tiny_config(tmp_path / "config.json")).read())
    (tmp_path / "config.json").write_text(json.dumps({**config, "vocab_size": 640}))
    base = [
        "train",
        str(tmp_path / "config.json"),
        "--tokenizer",
        str(folder),
        "--data",
        sample,
        "--chat-template",
        os.path.join(examples, "qa_training.jinja"),
        "--assistant-only-loss",
        "--max-length",
        "128",
        "--batch-size",
        "4",
        "--max-steps",
        "1",
        "--output-dir",
        str(tmp_path / "out"),
        "--no-save",
        "--quiet",
    ]
    rates = {}
    for name, extra in (
        ("full", []),
        ("lora", ["--lora-r", "4"]),
        ("lora, set", ["--lora-r", "4", "--learning-rate", "1e-3"]),
    ):
        assert main(base + extra) == 0
        summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert 0 < summary["loss_token_share"] < 1
        rates[name] = summary["learning_rate"]
    assert rates == {"full": 5e-5, "lora": 2e-4, "lora, set": 1e-3}
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "(default: 5e-5, transformers'; 2e-4 with --lora-r" in " ".join(capsys.readouterr().out.split())
