"""The chat stage of the demo: teach the demo model to answer questions about the Python docs.

`chat_stage(model_dir, out_dir)` takes the model `examples/demo.py` trained (a Qwen3-architecture
model and a BPE tokenizer, trained on `pydoc_data.topics`), writes a small training chat template
(`Question: ...` / `Answer: ...`, the answer inside `{% generation %}`), builds a few synthetic
conversations from the docs (for each statement, three ways of asking what it does; the answer is
the first sentence the docs give), fine-tunes on them with `assistant_only_loss=True` (the loss
falls on the answers, never on the questions), saves the result under `out_dir`, then answers
questions through the chat template (`apply_chat_template(..., add_generation_prompt=True)` and
greedy `generate`), one of them phrased in a way it never saw. It prints what it does and returns
its timings, losses and answers.

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
        rows.extend({"messages": [{"role": "user", "content": q.format(subject)},
                                  {"role": "assistant", "content": answer}]} for q in ASKED)
    return rows, answers


def questions() -> list[tuple[str, str, str]]:
    """(question, subject, the docs' answer): three asked as in training, one phrased in a way it never saw."""
    _, answers = conversations()
    subjects = list(answers)
    asked = [(ASKED[0].format(s), s) for s in subjects[:3]] + [(UNSEEN.format(subjects[0]), subjects[0])]
    return [(q, s, answers[s]) for q, s in asked]


def chat_stage(model_dir: str, out_dir: str, steps: int = 60, compile: bool = False, bf16: bool | None = None,
               learning_rate: float = 3e-3, answer: bool = True) -> dict:
    """Fine-tune `model_dir` on the synthetic conversations (assistant-only loss), save to `out_dir`, and
    (`answer`) ask `questions()` through the chat template with `generate`."""
    from staticformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

    start = time.perf_counter()
    os.makedirs(out_dir, exist_ok=True)
    template_path = os.path.join(out_dir, "train_chat_template.jinja")
    with open(template_path, "w", encoding="utf-8") as f:
        f.write(TEMPLATE)
    rows, answers = conversations()
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if bf16 is None:
        from staticformers.backends.devices import auto_device, supports_bf16

        bf16 = supports_bf16(auto_device())
    args = TrainingArguments(
        output_dir=os.path.join(out_dir, "run"), max_length=96, per_device_train_batch_size=8, max_steps=steps,
        learning_rate=learning_rate, lr_scheduler_type="constant_with_warmup", warmup_steps=5, logging_steps=max(1, steps // 6),
        save_strategy="no", bf16=bf16, torch_compile=compile, seed=0, disable_tqdm=True,
        assistant_only_loss=True, chat_template_path=template_path, packing=True)
    trainer = Trainer(model=model, args=args, train_dataset=rows, processing_class=tok)
    out = trainer.train()
    trainer.save_model(out_dir)
    m = out.metrics
    losses = [e["loss"] for e in trainer.state.log_history if "grad_norm" in e]
    print(f"chat: {len(rows)} synthetic conversations about {len(answers)} statements, {out.global_step} steps with "
          f"assistant-only loss in {m['train_runtime']:.1f}s: loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
          f"{100 * m['train_loss_token_share']:.1f}% of the tokens carry loss "
          f"(padding waste {100 * m['train_padding_waste']:.1f}%)")
    trained = time.perf_counter()
    summary = {"train_seconds": round(trained - start, 2), "first_loss": losses[0], "last_loss": losses[-1],
               "loss_token_share": m["train_loss_token_share"], "padding_waste": m["train_padding_waste"]}
    if not answer:
        return summary

    tok = AutoTokenizer.from_pretrained(out_dir)  # the saved tokenizer carries the chat template
    model = AutoModelForCausalLM.from_pretrained(out_dir, device_map="auto")
    results = []
    for question, subject, _ in questions():
        ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                      return_tensors="pt")
        generated = model.generate(ids, max_new_tokens=48, do_sample=False)
        reply = tok.decode(generated[0, ids.shape[1]:], skip_special_tokens=True).strip()
        results.append({"question": question, "answer": reply, "expected": answers[subject],
                        "exact": reply == answers[subject]})
        print(f"  Q: {question}\n  A: {reply}{'' if reply == answers[subject] else '   (docs: ' + answers[subject] + ')'}")
    done = time.perf_counter()
    print(f"chat: {sum(r['exact'] for r in results)} of {len(results)} answers exactly as the docs say; "
          f"training {trained - start:.1f}s, answering {done - trained:.1f}s (including compiles)")
    return {**summary, "answer_seconds": round(done - trained, 2), "seconds": round(done - start, 2),
            "answers": results}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=os.path.join(DEMO, "model"), help="the model examples/demo.py trained")
    parser.add_argument("--out", default=os.path.join(DEMO, "chat"))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--compile", action="store_true")
    a = parser.parse_args()
    if not os.path.exists(os.path.join(a.model, "model.safetensors")):
        print(f"{a.model} holds no trained model: run `make demo` (examples/demo.py) first.", file=sys.stderr)
        return 2
    chat_stage(a.model, a.out, a.steps, a.compile, learning_rate=a.learning_rate)
    return 0


if __name__ == "__main__":
    sys.exit(main())
