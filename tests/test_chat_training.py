"""Chat fine-tuning: `messages` and `prompt`/`completion` datasets, assistant-only and completion-only loss.

The oracle is transformers: its tokenizer's assistant masks give the expected labels, and its model's
loss on our batches (same ids, same labels) is the expected loss, padded and packed.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from chat_fixtures import CONVERSATIONS, PLAIN_TRAINING_TEMPLATE, QWEN_TRAINING_TEMPLATE, WEATHER_TOOLS
from staticformers import AutoTokenizer, Trainer, TrainingArguments
from staticformers.training.data import IGNORE_INDEX, build_rows
from tokenizer_fixtures import QWEN_TEMPLATE, build_qwen

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 640  # the qwen fixture tokenizer has 604 tokens


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory):
    return build_qwen(tmp_path_factory.mktemp("chat_training") / "qwen")


@pytest.fixture
def tok(qwen_folder):
    tok = AutoTokenizer.from_pretrained(qwen_folder)
    tok.chat_template = QWEN_TRAINING_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def ref_tok(qwen_folder):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoTokenizer.from_pretrained(qwen_folder)


def dataset():
    return [{"messages": c, **({"tools": WEATHER_TOOLS} if i == 2 else {})} for i, c in enumerate(CONVERSATIONS)]


def expected_labels(ref_tok, example):
    out = ref_tok.apply_chat_template(
        example["messages"],
        tools=example.get("tools"),
        chat_template=QWEN_TRAINING_TEMPLATE,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    return out["input_ids"], [t if m else IGNORE_INDEX for t, m in zip(out["input_ids"], out["assistant_masks"])]


def args_for(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path),
        max_length=128,
        per_device_train_batch_size=4,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        learning_rate=1e-3,
        seed=0,
        use_cpu=True,
    )
    return TrainingArguments(**{**base, **kw})


def documents_in(rows, pad_id):
    """(ids, labels) of every document (or piece) in a RowTable, read back from its rows."""
    out = []
    for r in range(rows.num_rows):
        ids, labels = rows.input_ids[r].tolist(), rows.labels[r].tolist()
        if rows.position_ids is None:  # padding: one piece per row, then pad tokens
            n = len(ids)
            while n and ids[n - 1] == pad_id:
                n -= 1
            out.append((ids[:n], labels[:n]))
            continue
        pos = rows.position_ids[r].tolist()
        starts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
        out.extend((ids[a:b], labels[a:b]) for a, b in zip(starts, starts[1:]) if ids[a] != pad_id)
    return out


def assert_pieces_keep_labels(found, originals, max_length, packed):
    """Every piece is a max_length-aligned slice of one original document, with that slice's labels."""
    for ids, labels in found:
        matches = [
            (o_ids, o_labels, s)
            for o_ids, o_labels in originals
            for s in range(0, len(o_ids), max_length)
            if o_ids[s : s + len(ids)] == ids
        ]
        assert matches, ids
        o_ids, o_labels, s = matches[0]
        want = o_labels[s : s + len(ids)]
        if packed:
            want = [IGNORE_INDEX] + want[1:]  # a packed piece's first token never predicts across documents
        assert labels == want
    assert sum(len(ids) for ids, _ in found) == sum(len(ids) for ids, _ in originals)


# ---------------------------------------------------------------------------------------------
# labels
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("packing", [False, True])
def test_assistant_only_labels_are_transformers_masks_padded_and_packed(tok, ref_tok, packing):
    rows = build_rows(dataset(), tok, 512, packing, assistant_only_loss=True)
    originals = [expected_labels(ref_tok, e) for e in dataset()]
    found = documents_in(rows, tok.pad_token_id)
    assert len(found) == len(originals)
    assert_pieces_keep_labels(found, originals, 512, packing)
    assert rows.loss_tokens < rows.real_tokens and 0 < rows.loss_token_share < 1 - rows.padding_waste
    assert rows.stats()["loss_token_share"] == pytest.approx(rows.loss_token_share, abs=1e-6)


def test_full_loss_without_assistant_only(tok, ref_tok):
    rows = build_rows(dataset(), tok, 512, False)
    ids, _ = expected_labels(ref_tok, dataset()[1])
    assert rows.input_ids[1, : len(ids)].tolist() == ids and rows.labels[1, : len(ids)].tolist() == ids


@pytest.mark.parametrize("packing,strategy", [(False, "bfd"), (True, "bfd"), (True, "wrapped")])
def test_long_conversations_are_split_with_their_labels(tok, ref_tok, caplog, packing, strategy):
    originals = [expected_labels(ref_tok, e) for e in dataset()]
    assert max(len(ids) for ids, _ in originals) > 2 * 64
    rows = build_rows(dataset(), tok, 64, packing, packing_strategy=strategy, assistant_only_loss=True)
    assert "documents are longer than max_length=64" in caplog.text
    if strategy == "wrapped":  # pieces end where rows end: the row stream is the document stream
        n = sum(len(ids) for ids, _ in originals)
        ids = rows.input_ids.reshape(-1)[:n].tolist()
        labels = rows.labels.reshape(-1)[:n].tolist()
        starts = (rows.position_ids.reshape(-1)[:n] == 0).tolist()
        want_labels = [lab for _, o in originals for lab in o]
        assert ids == [t for o, _ in originals for t in o]
        assert labels == [IGNORE_INDEX if first else lab for lab, first in zip(want_labels, starts)]
        return
    assert_pieces_keep_labels(documents_in(rows, tok.pad_token_id), originals, 64, packing)


def test_long_conversation_truncated_keeps_its_first_labels(tok, ref_tok):
    ids, labels = expected_labels(ref_tok, dataset()[3])
    cut = build_rows(dataset()[3:], tok, 64, False, long_documents="truncate", assistant_only_loss=True)
    assert cut.num_rows == 1 and cut.input_ids[0].tolist() == ids[:64] and cut.labels[0].tolist() == labels[:64]


def test_prompt_completion_strings_and_messages(tok):
    prompt_ids = tok("Hello world! ")["input_ids"]
    rows = build_rows([{"prompt": "Hello world! ", "completion": "How are you?"}], tok, 64, False)
    full = tok("Hello world! How are you?")["input_ids"] + [tok.eos_token_id]
    assert full[: len(prompt_ids)] == prompt_ids
    assert rows.input_ids[0, : len(full)].tolist() == full
    assert rows.labels[0, : len(full)].tolist() == [IGNORE_INDEX] * len(prompt_ids) + full[len(prompt_ids) :]
    everything = build_rows(
        [{"prompt": "Hello world! ", "completion": "How are you?"}], tok, 64, False, completion_only_loss=False
    )
    assert everything.labels[0, : len(full)].tolist() == full

    prompt = [{"role": "user", "content": "What is 2+2?"}]
    completion = [{"role": "assistant", "content": "4", "reasoning_content": "add"}]
    convo = tok.apply_chat_template(prompt + completion)
    header = tok.apply_chat_template(prompt, add_generation_prompt=True)
    assert convo[: len(header)] == header
    rows = build_rows([{"prompt": prompt, "completion": completion}], tok, 64, False)
    assert rows.labels[0, : len(convo)].tolist() == [IGNORE_INDEX] * len(header) + convo[len(header) :]
    # both masks at once: the user turn inside the completion is not the assistant's
    completion2 = completion + [{"role": "user", "content": "thanks"}]
    both = build_rows([{"prompt": prompt, "completion": completion2}], tok, 64, False, assistant_only_loss=True)
    out = tok.apply_chat_template(prompt + completion2, return_dict=True, return_assistant_tokens_mask=True)
    want = [t if m else IGNORE_INDEX for t, m in zip(out["input_ids"], out["assistant_masks"])]
    assert both.labels[0, : len(want)].tolist() == want and want[-1] == IGNORE_INDEX


def test_tools_as_json_text_and_template_kwargs(tok):
    plain = build_rows([{"messages": CONVERSATIONS[2], "tools": WEATHER_TOOLS}], tok, 512, False)
    as_text = build_rows([{"messages": CONVERSATIONS[2], "tools": json.dumps(WEATHER_TOOLS)}], tok, 512, False)
    none = build_rows([{"messages": CONVERSATIONS[2]}], tok, 512, False)
    assert torch.equal(plain.input_ids, as_text.input_ids) and plain.real_tokens > none.real_tokens + 50
    tok.chat_template = "{{ greeting }}" + PLAIN_TRAINING_TEMPLATE
    greeted = build_rows(
        [{"messages": CONVERSATIONS[0], "chat_template_kwargs": {"greeting": "Hello world!"}}], tok, 64, False
    )
    assert tok.decode(greeted.input_ids[0, : greeted.real_tokens]) == "Hello world!" + tok.apply_chat_template(
        CONVERSATIONS[0], tokenize=False, greeting=""
    )


@pytest.mark.parametrize(
    "example,kw,match",
    [
        ({"text": "plain text"}, dict(assistant_only_loss=True), "example 0 is text"),
        ({"input_ids": [1, 2, 3]}, dict(assistant_only_loss=True), "example 0 is token ids"),
        ({"prompt": "a", "completion": "b"}, dict(assistant_only_loss=True), "a prompt-completion pair of strings"),
        (
            {"messages": [{"role": "user", "content": "only a user"}]},
            dict(assistant_only_loss=True),
            "no assistant tokens",
        ),
        ({"messages": "hello"}, {}, "not a non-empty list"),
        ({"messages": []}, {}, "not a non-empty list"),
        ({"prompt": "a"}, {}, "has a 'prompt' but no 'completion'"),
        ({"prompt": "a", "completion": [{"role": "assistant", "content": "b"}]}, {}, "different kinds"),
        ({"messages": CONVERSATIONS[0], "tools": "{not json"}, {}, "'tools' that are not valid JSON"),
        ({"messages": CONVERSATIONS[0], "chat_template_kwargs": [1]}, {}, "'chat_template_kwargs' that are not a dict"),
        ({"text": "x"}, dict(completion_only_loss=True), "completion_only_loss=True needs 'prompt'/'completion'"),
        (
            {"messages": [{"role": "robot", "content": "x"}]},
            dict(template=QWEN_TEMPLATE),
            "Example 0 could not be rendered with the chat template: Unknown role: robot",
        ),
    ],
)
def test_bad_chat_data_gets_one_sentence(tok, example, kw, match):
    if "template" in kw:
        tok.chat_template = kw.pop("template")
    with pytest.raises(ValueError, match=match):
        build_rows([example], tok, 64, False, **kw)


def test_template_without_generation_blocks_and_no_tokenizer(tok, ref_tok):
    tok.chat_template = QWEN_TEMPLATE
    with pytest.raises(ValueError, match=r"Example 0: .*has no such blocks.*chat_template_path"):
        build_rows(dataset()[:1], tok, 64, False, assistant_only_loss=True)
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
        build_rows(dataset()[:1], None, 64, False)
    with warnings.catch_warnings():  # transformers' tokenizer only warns and gives an all-zero mask
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=r"no assistant tokens.*chat_template_path"):
            build_rows(dataset()[:1], ref_tok, 64, False, assistant_only_loss=True)


# ---------------------------------------------------------------------------------------------
# chat_template_path
# ---------------------------------------------------------------------------------------------
def test_chat_template_path_file_and_folder(qwen_folder, tmp_path, tiny_checkpoints):
    from staticformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3", vocab_size=VOCAB))
    (tmp_path / "train.jinja").write_text(PLAIN_TRAINING_TEMPLATE)
    tok = AutoTokenizer.from_pretrained(qwen_folder)
    trainer = Trainer(
        model=model,
        args=args_for(tmp_path, chat_template_path=str(tmp_path / "train.jinja")),
        train_dataset=dataset(),
        processing_class=tok,
    )
    assert tok.chat_template == PLAIN_TRAINING_TEMPLATE
    trainer.save_model(str(tmp_path / "saved"))
    assert AutoTokenizer.from_pretrained(tmp_path / "saved").chat_template == PLAIN_TRAINING_TEMPLATE
    other = AutoTokenizer.from_pretrained(qwen_folder)
    Trainer(model=model, args=args_for(tmp_path, chat_template_path=str(tmp_path / "saved")), processing_class=other)
    assert other.chat_template == PLAIN_TRAINING_TEMPLATE

    with pytest.raises(ValueError, match="chat_template_path='nowhere.jinja' does not exist"):
        args_for(tmp_path, chat_template_path="nowhere.jinja")
    (tmp_path / "empty.jinja").write_text(" \n")
    with pytest.raises(ValueError, match="is an empty file"):
        Trainer(
            model=model,
            args=args_for(tmp_path, chat_template_path=str(tmp_path / "empty.jinja")),
            processing_class=AutoTokenizer.from_pretrained(qwen_folder),
        )
    with pytest.raises(ValueError, match="no tokenizer was given"):
        Trainer(model=model, args=args_for(tmp_path, chat_template_path=str(tmp_path / "train.jinja")))


def test_chat_template_folder_whose_tokens_this_tokenizer_lacks(qwen_folder, tmp_path, tiny_checkpoints):
    from staticformers import AutoModelForCausalLM
    from tokenizer_fixtures import build_llama3

    llama = AutoTokenizer.from_pretrained(build_llama3(tmp_path / "llama3"))
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3", vocab_size=VOCAB))
    with pytest.raises(
        ValueError,
        match=r"writes token\(s\) </think>, .*<\|im_end\|>, <\|im_start\|> that this tokenizer does not have",
    ):
        Trainer(model=model, args=args_for(tmp_path, chat_template_path=str(qwen_folder)), processing_class=llama)


# ---------------------------------------------------------------------------------------------
# the loss
# ---------------------------------------------------------------------------------------------
def chat_trainer(tmp_path, tiny_checkpoints, tok, data, **kw):
    from staticformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3", vocab_size=VOCAB))
    args = args_for(tmp_path, assistant_only_loss=True, **kw)
    return Trainer(model=model, args=args, train_dataset=data, processing_class=tok)


def loss_of(trainer, rows=None):
    rows = rows or trainer.get_train_rows()
    batch = rows.batch(list(range(rows.num_rows)))
    n = torch.tensor(rows.loss_tokens)
    return trainer.compute_loss(trainer.model.train(), batch, n).detach(), batch


@pytest.mark.parametrize("packing", [False, True])
def test_loss_equals_transformers_on_the_same_ids_and_labels(tok, tmp_path, tiny_checkpoints, packing):
    trainer = chat_trainer(tmp_path, tiny_checkpoints, tok, dataset(), packing=packing)
    loss, batch = loss_of(trainer)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3", vocab_size=VOCAB)).eval()
    if packing:  # transformers reads the restarting positions as document boundaries (no cache, no mask)
        kw = {"position_ids": batch["position_ids"]}
    else:
        kw = {"attention_mask": (batch["input_ids"] != tok.pad_token_id).long()}
    with torch.no_grad():
        ref = theirs(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False, **kw).loss
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    assert (batch["labels"] == IGNORE_INDEX).float().mean() > 0.4  # most positions carry no loss: the masks matter
    other = chat_trainer(tmp_path, tiny_checkpoints, tok, dataset(), packing=not packing)
    torch.testing.assert_close(loss_of(other)[0], loss, rtol=1e-5, atol=1e-6)  # packed == padded


def test_user_words_reach_the_loss_only_through_the_context(tok, tmp_path, tiny_checkpoints):
    data = dataset()
    trainer = chat_trainer(tmp_path, tiny_checkpoints, tok, data)
    base, batch = loss_of(trainer)
    user_next = batch["labels"][:, 1:] == IGNORE_INDEX  # positions whose next token carries no loss

    # the user's words change: the assistant's labels are the same tokens, and the loss moves (the context changed)
    changed = [
        dict(
            e,
            messages=[
                dict(m, content=m["content"].replace("Paris", "Tokyo").replace("2+2", "5+5"))
                if m["role"] == "user"
                else m
                for m in e["messages"]
            ],
        )
        for e in data
    ]
    other = chat_trainer(tmp_path, tiny_checkpoints, tok, changed)
    moved, other_batch = loss_of(other)
    assert sorted(other_batch["labels"][other_batch["labels"] != IGNORE_INDEX].tolist()) == sorted(
        batch["labels"][batch["labels"] != IGNORE_INDEX].tolist()
    )
    assert abs(float(moved) - float(base)) > 1e-4

    # what the model predicts where the next token is the user's never counts: perturb those predictions
    norm = trainer.model.model.norm

    def perturb(where):
        def hook(module, args, output):
            noise = torch.zeros_like(output)
            noise[:, :-1][where] = 5.0
            return output + noise * torch.randn_like(output)

        return norm.register_forward_hook(hook)

    handle = perturb(user_next)
    try:
        perturbed, _ = loss_of(trainer)
    finally:
        handle.remove()
    torch.testing.assert_close(perturbed, base, rtol=0, atol=1e-6)
    assistant_next = ~user_next
    handle = perturb(assistant_next)
    try:
        hit, _ = loss_of(trainer)
    finally:
        handle.remove()
    assert abs(float(hit) - float(base)) > 1e-3  # the same perturbation where the assistant speaks does count


def test_loss_token_share_in_logs_metrics_and_jsonl(tok, tmp_path, tiny_checkpoints, caplog):
    trainer = chat_trainer(tmp_path, tiny_checkpoints, tok, dataset() * 2, max_steps=1, per_device_train_batch_size=2)
    out = trainer.train()
    rows = trainer.get_train_rows()
    share = out.metrics["train_loss_token_share"]
    assert share == pytest.approx(rows.loss_tokens / rows.input_ids.numel(), abs=1e-6) and 0 < share < 0.6
    assert f"tokens with loss {100 * share:.2f}%" in caplog.text and "padding waste" in caplog.text
    last = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")][-1]
    assert last["train_loss_token_share"] == share and "train_padding_waste" in last


# ---------------------------------------------------------------------------------------------
# learning
# ---------------------------------------------------------------------------------------------
COLORS = {"sky": "blue", "grass": "green", "sun": "yellow", "snow": "white", "night": "black", "fire": "red"}


def color_question(thing, rng):
    return f"Question {rng.randint(100, 999)}: what color is the {thing}?"  # the number is noise no one can learn


def test_a_tiny_model_learns_a_question_format_from_the_assistant_turns_only(tok, tmp_path):
    import random

    from staticformers import AutoConfig, AutoModelForCausalLM

    rng = random.Random(0)
    data = [
        {"messages": [{"role": "user", "content": color_question(thing, rng)}, {"role": "assistant", "content": color}]}
        for _ in range(8)
        for thing, color in COLORS.items()
    ]
    config = AutoConfig.for_model(
        "qwen3",
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
    )
    model = AutoModelForCausalLM.from_config(config, seed=0)
    args = args_for(
        tmp_path,
        max_length=64,
        per_device_train_batch_size=8,
        max_steps=60,
        logging_steps=10,
        learning_rate=3e-3,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=2,
        packing=True,
        assistant_only_loss=True,
        torch_compile=True,
        torch_compile_backend="aot_eager",
    )
    trainer = Trainer(model=model, args=args, train_dataset=data, processing_class=tok)
    out = trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "grad_norm" in e]
    assert losses[-1] < 0.1 * losses[0], losses
    assert 0 < out.metrics["train_loss_token_share"] < 0.3  # the question turns carry no loss

    # the loss the model trained on falls on the assistant's tokens; the user's it never learned
    model.eval()
    assistant = build_rows(data, tok, 64, False, assistant_only_loss=True)
    everything = build_rows(data, tok, 64, False)
    with torch.no_grad():
        logits = model(input_ids=assistant.input_ids).logits[:, :-1]
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), everything.labels[:, 1:], reduction="none")
    said = assistant.labels[:, 1:] != IGNORE_INDEX
    asked = (everything.labels[:, 1:] != IGNORE_INDEX) & ~said
    assert ce[said].mean() < 0.5 and ce[asked].mean() > 4.0, (ce[said].mean(), ce[asked].mean())

    # new questions, answered through the chat template
    right = 0
    for thing, color in COLORS.items():
        ids = tok.apply_chat_template(
            [{"role": "user", "content": color_question(thing, rng)}], add_generation_prompt=True, return_tensors="pt"
        )
        answer = tok.decode(
            model.generate(ids, max_new_tokens=12, do_sample=False, disable_compile=True)[0, ids.shape[1] :]
        )
        right += answer == f"<think>\n\n</think>\n\n{color}<|im_end|>"
    assert right >= 5, right

    trainer.evaluate(data)
    trainer.evaluate(data)
    stats = trainer.compile_stats()
    assert stats["train_graphs"] == 2 and stats["eval_graphs"] == 2, stats  # 60 steps, two evaluations: no new shape


def test_a_template_that_leaves_the_end_of_turn_out_of_the_mask_is_named(tok, caplog):
    build_rows(dataset(), tok, 512, False, assistant_only_loss=True)
    assert "never learns to stop" not in caplog.text  # <|im_end|> is inside the Qwen3 training template's blocks
    tok.chat_template = PLAIN_TRAINING_TEMPLATE
    build_rows(dataset(), tok, 512, False, assistant_only_loss=True)
    assert caplog.text.count("never learns to stop") == 1  # once per dataset
