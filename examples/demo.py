"""`make demo`: train a tokenizer and a small Qwen3 model from scratch on Python's own docs, then generate.

1. Prints what `staticformers doctor` prints: the devices here and the one "auto" picks.
2. Trains a byte-level BPE tokenizer (the `tokenizers` library) on the Python documentation that
   ships with CPython (`pydoc_data.topics`), and a small Qwen3-architecture model on the same text
   with `Trainer` (packed rows of fixed shape, bf16 when the device has it; `--compile` compiles the
   step (a decoder layer and the head: two graphs), off by default because on a 2-core CPU the compile costs more than it saves
   over a run this short).
3. Saves both in Hugging Face format under `.demo/model` (transformers loads it).
4. Loads it back with `AutoModelForCausalLM` / `AutoTokenizer` and generates greedily with the
   engine (static KV cache, compiled prefill and decode), printing compile statistics.

A second run finds `.demo/model` and only does steps 1 and 4 (compiled graphs come from the on-disk
cache). `--retrain` trains again; `--steps N` changes the training length.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
DEMO = os.path.join(ROOT, ".demo")
MODEL_DIR = os.path.join(DEMO, "model")
EOS = "<|endoftext|>"
PROMPTS = ["The for statement", "A class definition", "The import statement"]


def doctor() -> None:
    from types import SimpleNamespace

    from staticformers.commands import doctor as doctor_command

    doctor_command.run(SimpleNamespace(json=False))


def corpus() -> list[str]:
    from pydoc_data.topics import topics

    docs = []
    for key in sorted(topics):
        for part in topics[key].split("\n\n"):
            part = " ".join(part.split())
            if len(part) > 40:
                docs.append(part)
    return docs


def train_tokenizer(docs: list[str], directory: str, vocab_size: int = 4096):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer)
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": EOS,
                   "model_max_length": 512}, f, indent=2)


def train(steps: int, compile: bool) -> dict:

    from staticformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

    docs = corpus()
    start = time.perf_counter()
    train_tokenizer(docs, MODEL_DIR)
    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    print(f"tokenizer: BPE, {tok.vocab_size} tokens, trained on {len(docs)} paragraphs of pydoc_data.topics "
          f"in {time.perf_counter() - start:.1f}s")
    config = AutoConfig.for_model(
        "qwen3", vocab_size=tok.vocab_size, hidden_size=192, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=48, tie_word_embeddings=True,
        max_position_embeddings=512, eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
    model = AutoModelForCausalLM.from_config(config, seed=0)
    print(f"model: Qwen3 architecture, {model.num_parameters() / 1e6:.2f}M parameters, from scratch")
    args = TrainingArguments(
        output_dir=os.path.join(DEMO, "run"), max_length=128, packing=True, per_device_train_batch_size=8,
        max_steps=steps, learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=max(1, steps // 20),
        weight_decay=0.01, logging_steps=max(1, steps // 10), save_strategy="no", bf16=_bf16_ok(), torch_compile=compile, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=[{"text": d} for d in docs], processing_class=tok)
    out = trainer.train()
    trainer.save_model(MODEL_DIR)
    m = out.metrics
    print(f"trained {out.global_step} steps in {m['train_runtime']:.0f}s: loss {out.training_loss:.3f} "
          f"(last logged {[e['loss'] for e in trainer.state.log_history if 'grad_norm' in e][-1]:.3f}), "
          f"{m['train_steady_tokens_per_second'] or 0:,.0f} tokens/s steady, first step {m['train_first_step_seconds']:.1f}s, "
          f"padding waste {100 * m['train_padding_waste']:.2f}%")
    print(f"training compile: {json.dumps(trainer.compile_stats())}")
    print(f"saved model and tokenizer (Hugging Face format) to {MODEL_DIR}; loss curve {args.output_dir}/loss_curve.png")
    return m


def _bf16_ok() -> bool:
    from staticformers.devices import auto_device, supports_bf16

    return supports_bf16(auto_device())


def generate() -> None:
    from staticformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, device_map="auto")
    start = time.perf_counter()
    for prompt in PROMPTS:
        inputs = tok(prompt, return_tensors="pt")
        out = model.generate(**inputs, max_new_tokens=32, do_sample=False, repetition_penalty=1.3)
        print(f"> {prompt}{tok.decode(out[0, inputs['input_ids'].shape[1]:], skip_special_tokens=True)}")
    print(f"generated {len(PROMPTS)} x 32 tokens in {time.perf_counter() - start:.1f}s (including compiles)")
    for graph in model.compile_stats():
        print("generation compile:", json.dumps(graph, default=str))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--retrain", action="store_true")
    parser.add_argument("--compile", action="store_true",
                        help="compile the training step too (two graphs; costs a compile of tens of seconds on a small CPU)")
    a = parser.parse_args()
    start = time.perf_counter()
    doctor()
    have = all(os.path.exists(os.path.join(MODEL_DIR, f)) for f in ("config.json", "model.safetensors", "tokenizer.json"))
    if have and not a.retrain:
        print(f"reusing the model trained earlier in {MODEL_DIR} (--retrain to train again)")
    else:
        train(a.steps, a.compile)
    generate()
    print(f"demo done in {time.perf_counter() - start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
