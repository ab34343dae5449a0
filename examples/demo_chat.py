"""The chat stage of the demo: teach the demo model to answer questions about the Python docs.

`chat_stage(model_dir, out_dir)` takes the model `examples/demo.py` trained (a Qwen3-architecture
model and a BPE tokenizer, trained on `pydoc_data.topics`), writes a small training chat template
(`Question: ...` / `Answer: ...`, the answer inside `{% generation %}`), builds a few synthetic
conversations from the docs (for each statement, three ways of asking what it does; the answer is
the first sentence the docs give), fine-tunes on them with `assistant_only_loss=True` (the loss
falls on the answers, never on the questions; a cosine schedule after a short warm-up, so the run
ends on small steps), saves the result under `out_dir`, and prints an evaluation: how many of the
trained questions the model answers exactly as the docs say, and how many of the same statements
asked in a phrasing training never saw (`UNSEEN`: a probe of how far memorising 36 conversations
carries, not a score to reach). With `answer=True` it then answers `questions()` through the chat
template (`apply_chat_template(..., add_generation_prompt=True)` and greedy `generate`). It returns
its timings, losses and evaluation.

Run alone after `make demo` has trained `.demo/model`: `python examples/demo_chat.py`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
DEMO = os.path.join(ROOT, ".demo")

# the training chat template (`Question: ...` / `Answer: ...`, the answer inside `{% generation %}`), a file so
# that `staticformers train --chat-template examples/qa_training.jinja` uses the same one
TEMPLATE_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "qa_training.jinja")
with open(TEMPLATE_FILE, encoding="utf-8") as _f:
    TEMPLATE = _f.read()
SAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat_sample.jsonl")  # conversations() as a file

TOPICS = ("for", "while", "if", "try", "with", "assert", "pass", "return", "lambda", "class", "function", "import")
ASKED = ("What does {} do?", "Explain {} in one sentence.", "Tell me about {}.")
UNSEEN = "In one sentence, what is {} for?"


def first_sentence(text: str) -> str | None:
    """The first prose sentence of a pydoc topic (its title and grammar blocks skipped)."""
    for paragraph in text.split("\n\n")[1:]:
        if paragraph.startswith(" ") or paragraph.startswith("*"):
            continue
        prose = " ".join(paragraph.split())
        end = min((i for i in (prose.find(". "), prose.find(":")) if i > 0), default=len(prose))
        return prose[:end].rstrip(".") + "."
    return None


def conversations() -> tuple[list[dict], dict[str, str]]:
    """Synthetic Q&A conversations (`messages` rows) and, per topic title, the answer they teach."""
    from pydoc_data.topics import topics

    rows, answers = [], {}
    for key in TOPICS:
        title = topics[key].split("\n", 1)[0].strip()
        answer = first_sentence(topics[key])
        if not answer:
            continue
        subject = title[0].lower() + title[1:]  # 'The "for" statement' -> 'the "for" statement'
        answers[subject] = answer
        rows.extend(
            {"messages": [{"role": "user", "content": q.format(subject)}, {"role": "assistant", "content": answer}]}
            for q in ASKED
        )
    return rows, answers


def questions() -> list[tuple[str, str, str]]:
    """(question, subject, the docs' answer): three asked as in training, one phrased in a way it never saw."""
    _, answers = conversations()
    subjects = list(answers)
    asked = [(ASKED[0].format(s), s) for s in subjects[:3]] + [(UNSEEN.format(subjects[0]), subjects[0])]
    return [(q, s, answers[s]) for q, s in asked]


STEPS = 100  # the 36 conversations pack into 21 rows of 96 tokens, two batches of 8: 50 passes over the data
LEARNING_RATE = 3e-3


def unseen_conversations() -> list[dict]:
    """The same statements asked in the phrasing training never saw (`UNSEEN`), with the docs' answers."""
    _, answers = conversations()
    return [
        {"messages": [{"role": "user", "content": UNSEEN.format(s)}, {"role": "assistant", "content": a}]}
        for s, a in answers.items()
    ]


def answered_exactly(model, tok, rows: list[dict]) -> list[bool]:
    """For each conversation, whether greedy decoding after its question writes the docs' answer token for
    token. Teacher-forced, one forward pass over all of them (right-padded: a causal model's positions never
    see the padding after them): greedy decoding reproduces the answer exactly when, and only when, the
    model's most likely next token is the answer's own at every one of the assistant's positions (its
    end-of-text included)."""
    import torch

    encoded = [
        tok.apply_chat_template(row["messages"], return_dict=True, return_assistant_tokens_mask=True) for row in rows
    ]
    width = max(len(e["input_ids"]) for e in encoded)
    ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, e in enumerate(encoded):
        ids[i, : len(e["input_ids"])] = torch.tensor(e["input_ids"])
        mask[i, : len(e["input_ids"])] = torch.tensor(e["assistant_masks"], dtype=torch.bool)
    with torch.no_grad():
        predicted = model(input_ids=ids.to(model.device)).logits[:, :-1].argmax(-1).cpu()
    right = (predicted == ids[:, 1:]) | ~mask[:, 1:]
    return [bool(mask[i, 1:].any()) and bool(right[i].all()) for i in range(len(rows))]


def chat_stage(
    model_dir: str,
    out_dir: str,
    steps: int = STEPS,
    compile: bool = False,
    bf16: bool | None = None,
    learning_rate: float = LEARNING_RATE,
    answer: bool = True,
) -> dict:
    """Fine-tune `model_dir` on the synthetic conversations (assistant-only loss, cosine schedule), save to
    `out_dir`, print the evaluation (trained questions, and the unseen phrasing as a probe), and (`answer`)
    ask `questions()` through the chat template with `generate`."""
    from staticformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

    start = time.perf_counter()
    os.makedirs(out_dir, exist_ok=True)
    template_path = os.path.join(out_dir, "train_chat_template.jinja")
    with open(template_path, "w", encoding="utf-8") as f:
        f.write(TEMPLATE)
    rows, answers = conversations()
    unseen = unseen_conversations()
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if bf16 is None:
        from staticformers.backends.devices import auto_device, supports_bf16

        bf16 = supports_bf16(auto_device())
    args = TrainingArguments(
        output_dir=os.path.join(out_dir, "run"),
        max_length=96,
        per_device_train_batch_size=8,
        max_steps=steps,
        learning_rate=learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, steps // 10),
        logging_steps=max(1, steps // 6),
        save_strategy="no",
        bf16=bf16,
        torch_compile=compile,
        seed=0,
        disable_tqdm=False,
        assistant_only_loss=True,
        chat_template_path=template_path,
        packing=True,
    )  # the bar: a minutes-long stage must show progress
    trainer = Trainer(model=model, args=args, train_dataset=rows, processing_class=tok)
    out = trainer.train()
    trainer.save_model(out_dir)
    m = out.metrics
    logged = [e for e in trainer.state.log_history if "grad_norm" in e]
    losses = [e["loss"] for e in logged]
    print(
        f"chat: {len(rows)} synthetic conversations about {len(answers)} statements, {out.global_step} steps with "
        f"assistant-only loss (learning rate {learning_rate:g}, cosine after {args.warmup_steps} warm-up steps) in "
        f"{m['train_runtime']:.1f} s: loss {losses[0]:.3f} -> {losses[-1]:.3f} (last gradient norm "
        f"{logged[-1]['grad_norm']:.2f}), {100 * m['train_loss_token_share']:.1f}% of the tokens carry loss "
        f"(padding waste {100 * m['train_padding_waste']:.1f}%)"
    )
    trained = time.perf_counter()

    # the evaluation: the answers' loss and exact answers, on the trained questions and on the unseen phrasing
    tok = AutoTokenizer.from_pretrained(out_dir)  # the saved tokenizer carries the training template
    model.eval()
    seen_loss = trainer.evaluate(rows, metric_key_prefix="trained")["trained_loss"]
    unseen_loss = trainer.evaluate(unseen, metric_key_prefix="unseen")["unseen_loss"]
    seen_exact, unseen_exact = answered_exactly(model, tok, rows), answered_exactly(model, tok, unseen)
    print(
        f"evaluation (greedy answers, teacher-forced): the {len(rows)} trained questions: "
        f"{sum(seen_exact)} answered exactly as the docs say (answer loss {seen_loss:.3f}); "
        f'the {len(unseen)} statements asked as "{UNSEEN.format("...")}", a phrasing training never saw: '
        f"{sum(unseen_exact)} (answer loss {unseen_loss:.3f}). The first measures what was taught; the second "
        f"is a probe of how far 36 memorised conversations carry a 2M-parameter model, not a score to reach."
    )
    summary = {
        "train_seconds": round(trained - start, 2),
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "last_grad_norm": logged[-1]["grad_norm"],
        "loss_token_share": m["train_loss_token_share"],
        "padding_waste": m["train_padding_waste"],
        "trained_exact": sum(seen_exact),
        "trained": len(rows),
        "unseen_exact": sum(unseen_exact),
        "unseen": len(unseen),
        "trained_loss": seen_loss,
        "unseen_loss": unseen_loss,
    }
    if not answer:
        return summary

    model = AutoModelForCausalLM.from_pretrained(out_dir, device_map="auto")
    results = []
    for question, subject, _ in questions():
        ids = tok.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt"
        )
        generated = model.generate(ids, max_new_tokens=48, do_sample=False)
        reply = tok.decode(generated[0, ids.shape[1] :], skip_special_tokens=True).strip()
        results.append(
            {"question": question, "answer": reply, "expected": answers[subject], "exact": reply == answers[subject]}
        )
        print(
            f"  Q: {question}\n  A: {reply}{'' if reply == answers[subject] else '   (docs: ' + answers[subject] + ')'}"
        )
    done = time.perf_counter()
    print(
        f"chat: {sum(r['exact'] for r in results)} of {len(results)} answers exactly as the docs say; "
        f"training {trained - start:.1f}s, answering {done - trained:.1f}s (including compiles)"
    )
    return {
        **summary,
        "answer_seconds": round(done - trained, 2),
        "seconds": round(done - start, 2),
        "answers": results,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=os.path.join(DEMO, "model"), help="the model examples/demo.py trained")
    parser.add_argument("--out", default=os.path.join(DEMO, "chat"))
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--learning-rate", type=float, default=LEARNING_RATE)
    parser.add_argument("--compile", action="store_true")
    a = parser.parse_args()
    if not os.path.exists(os.path.join(a.model, "model.safetensors")):
        print(f"{a.model} holds no trained model: run `make demo` (examples/demo.py) first.", file=sys.stderr)
        return 2
    chat_stage(a.model, a.out, a.steps, a.compile, learning_rate=a.learning_rate)
    return 0


if __name__ == "__main__":
    sys.exit(main())
