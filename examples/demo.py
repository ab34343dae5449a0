"""`make demo`: train a tokenizer and a small Qwen3 from scratch on Python's own docs, compile its shape
plan ahead of time, then stream answers from it.

It runs as a list of stages (`STAGES`), each printing a numbered header and then its own progress:

1. devices   what `staticformers doctor` prints: the devices here and the one "auto" picks.
2. tokenizer a byte-level BPE tokenizer (the `tokenizers` library) trained on one topic (compound
             statements) of the documentation that ships with CPython (`pydoc_data.topics`).
3. train     a 2M-parameter Qwen3-architecture model trained from scratch on the same text with
             `Trainer` (packed rows of fixed shape, bf16 when the device has it, a progress bar, an
             evaluation on held-out paragraphs), saved in Hugging Face format under `.demo/model`
             with its loss curve; `--compile` compiles the training step too (two graphs; off by
             default: on a small CPU the compile costs more than it saves over a run this short).
4. compile   `staticformers compile` for the plan the answers need (batch 1, prompts up to 16
             tokens, a 256-token KV cache): each graph as it compiles, into the on-disk cache.
5. generate  the model loaded back with `AutoModelForCausalLM` / `AutoTokenizer`, each prompt's answer
             streamed (greedy), after a first call that loads the graphs, timed apart; then a table
             of new tokens and tokens/s per prompt.
6. chat      the same model fine-tuned on synthetic questions about those docs with assistant-only
             loss (`examples/demo_chat.py`: 36 `messages` conversations, a training chat template, a
             cosine schedule), saved under `.demo/chat`, then evaluated: the trained questions answered
             exactly as the docs say, and the same statements asked in a phrasing it never saw (a probe).
7. serve     `staticformers serve`'s server on the chat model (in this process, 127.0.0.1, a free
             port), its shape plan compiled first (one decode shape: four slots); four questions sent at
             once through the `openai` client (one streamed; three as trained, one phrased in a way
             training never saw), answered in one batch through the chat template; the answers against
             the docs', a summary of the server's metrics (nothing compiled while serving); then it stops.

Each stage's header ends with the time since the demo started (cumulative, not the stage's own).

A second run finds `.demo/model` and `.demo/chat` and skips stages 2, 3 and 6's training (`--retrain`
trains again; `--steps N` changes the training length); its graphs all come from the on-disk cache.
A later stage is added by appending a `Stage` to `STAGES`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # demo_chat.py
DEMO = os.environ.get("STATICFORMERS_DEMO_DIR", os.path.join(ROOT, ".demo"))  # another folder: tests
MODEL_DIR = os.path.join(DEMO, "model")
CORPUS = os.path.join(DEMO, "corpus.txt")  # the training text, one paragraph per blank-line block
EOS = "<|endoftext|>"
# one topic of the docs (compound statements: if, while, for, try, with, match, def, class; about 50k
# characters), so that 400 steps see each paragraph about 30 times: a 2M-parameter model then knows many
# of its sentences by heart (and little else), and each prompt opens one paragraph of it
TOPICS = ("compound",)
PROMPTS = [
    'The "for" statement is used to',
    'The "while" statement is used for',
    'The "try" statement specifies',
    'The "with" statement is used to',
]
MAX_NEW_TOKENS = 40
PLAN = dict(batch_sizes="1", prompt_lengths="16", kv_lengths="256", max_model_len="256")


def shown(path: str) -> str:
    """A path as the user typed it: relative to the repository when it is inside it."""
    rel = os.path.relpath(path, ROOT)
    return path if rel.startswith("..") else rel


@dataclass
class Demo:
    """What the stages share: the command-line options and what earlier stages produced."""

    args: argparse.Namespace
    start: float = field(default_factory=time.perf_counter)
    docs: list = field(default_factory=list)
    results: dict = field(default_factory=dict)

    @property
    def trained(self) -> bool:
        have = all(
            os.path.exists(os.path.join(MODEL_DIR, f)) for f in ("config.json", "model.safetensors", "tokenizer.json")
        )
        return have and not self.args.retrain


@dataclass
class Stage:
    name: str
    what: str
    run: Callable[[Demo], None]
    skip: Callable[[Demo], bool] = lambda demo: False
    reuses: str = MODEL_DIR  # what a skipped stage's output is


# ---- 1. devices ----------------------------------------------------------------------------------
def devices(demo: Demo) -> None:
    from staticformers.commands.cli import main as cli

    cli(["doctor"])


# ---- 2. tokenizer --------------------------------------------------------------------------------
def corpus() -> list[str]:
    from pydoc_data.topics import topics

    docs = []
    for key in TOPICS:
        for part in topics[key].split("\n\n"):
            part = " ".join(part.split())
            if len(part) > 40:
                docs.append(part)
    return docs


def tokenizer(demo: Demo, vocab_size: int = 2048) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    start = time.perf_counter()
    demo.docs = corpus()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(demo.docs, trainer)
    os.makedirs(MODEL_DIR, exist_ok=True)
    tok.save(os.path.join(MODEL_DIR, "tokenizer.json"))
    with open(os.path.join(MODEL_DIR, "tokenizer_config.json"), "w") as f:
        json.dump(
            {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": EOS, "model_max_length": 512},
            f,
            indent=2,
        )
    with open(CORPUS, "w", encoding="utf-8") as f:
        f.write("\n\n".join(demo.docs) + "\n")
    print(
        f"byte-level BPE, {tok.get_vocab_size()} tokens, trained on {len(demo.docs)} paragraphs "
        f"({sum(map(len, demo.docs)) / 1e3:.0f}k characters) of pydoc_data.topics ({', '.join(TOPICS)}) in {time.perf_counter() - start:.1f} s; "
        f"the text is in {shown(CORPUS)}"
    )


# ---- 3. train ------------------------------------------------------------------------------------
def train(demo: Demo) -> None:
    from staticformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments
    from staticformers.backends.devices import auto_device, supports_bf16

    a = demo.args
    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    config = AutoConfig.for_model(
        "qwen3",
        vocab_size=tok.vocab_size,
        hidden_size=192,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=48,
        tie_word_embeddings=True,
        max_position_embeddings=512,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id,
    )
    model = AutoModelForCausalLM.from_config(config, seed=0)
    docs = list(demo.docs)
    random.Random(0).shuffle(docs)
    opened = [d for d in docs if d.startswith(tuple(PROMPTS))]  # the paragraphs the prompts open are trained on
    docs = [d for d in docs if d not in opened]
    held_out, docs = docs[:24], docs[24:] + opened
    bf16 = supports_bf16(auto_device())
    shutil.rmtree(os.path.join(DEMO, "run"), ignore_errors=True)  # metrics.jsonl of an earlier run
    print(
        f"Qwen3 architecture, {model.num_parameters() / 1e6:.2f}M parameters from scratch; {len(docs)} paragraphs "
        f"(24 held out for evaluation), packed into rows of 128 tokens, batches of 8, {a.steps} steps, "
        f"{'bf16 with fp32 master weights' if bf16 else 'fp32'}"
    )
    args = TrainingArguments(
        output_dir=os.path.join(DEMO, "run"),
        run_name="make demo: a 2M-parameter Qwen3 from scratch on pydoc_data.topics (compound statements)",
        max_length=128,
        packing=True,
        per_device_train_batch_size=8,
        per_device_eval_batch_size=8,
        max_steps=a.steps,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, a.steps // 20),
        weight_decay=0.01,
        logging_steps=max(1, a.steps // 20),
        eval_strategy="steps",
        eval_steps=max(1, a.steps // 4),
        save_strategy="no",
        bf16=bf16,
        torch_compile=a.compile,
        seed=0,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=[{"text": d} for d in docs],
        eval_dataset=[{"text": d} for d in held_out],
        processing_class=tok,
    )
    out = trainer.train()
    trainer.save_model(MODEL_DIR)
    m, history = out.metrics, trainer.state.log_history
    losses = [e["loss"] for e in history if "grad_norm" in e]
    evals = [e["eval_loss"] for e in history if "eval_loss" in e]
    print(
        f"{out.global_step} steps in {m['train_runtime']:.0f} s: training loss {losses[0]:.2f} -> {losses[-1]:.2f}, "
        f"held-out loss {evals[-1]:.2f}; {m['train_steady_tokens_per_second'] or 0:,.0f} tokens/s, "
        f"padding waste {100 * m['train_padding_waste']:.1f}%"
    )
    if a.compile:
        s = trainer.compile_stats()
        print(
            f"training compile: {s['train_graphs']} training and {s['eval_graphs']} evaluation graphs "
            f"({s['backend']}) in {s['train_compile_seconds'] + s['eval_compile_seconds']:.1f} s"
        )
    curve = os.path.join(args.output_dir, "loss_curve.png")
    print(
        f"saved model and tokenizer (Hugging Face format) to {shown(MODEL_DIR)}"
        + (f"; loss curve {shown(curve)}" if os.path.exists(curve) else "")
        + f"; metrics {shown(os.path.join(args.output_dir, 'metrics.jsonl'))}"
    )


# ---- 4. compile ----------------------------------------------------------------------------------
def compile_plan(demo: Demo) -> None:
    from staticformers.commands.cli import main as cli

    flags = [f"--{k.replace('_', '-')}={v}" for k, v in PLAN.items()]
    print(f"$ staticformers compile {shown(MODEL_DIR)} {' '.join(flags)}", flush=True)
    if cli(["compile", MODEL_DIR, *flags]) != 0:
        raise SystemExit("the compile stage failed (its error is above)")


# ---- 5. generate ---------------------------------------------------------------------------------
def generate(demo: Demo) -> None:
    from staticformers import AutoModelForCausalLM, AutoTokenizer, ShapePlan, TextStreamer
    from staticformers.compilation.summary import CacheWatch, graphs_line
    from staticformers.utils.durations import duration

    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, device_map="auto")
    plan = ShapePlan(batch_sizes=[1], prompt_lengths=[16], kv_lengths=[256], max_model_len=256)
    print(
        f"greedy, at most {MAX_NEW_TOKENS} new tokens (or up to the end of a paragraph), static KV cache on {model.device}"
    )
    with CacheWatch() as loading:  # the first call loads (or compiles) the plan's graphs: timed apart
        start = time.perf_counter()
        model.generate(input_ids=tok(PROMPTS[0], return_tensors="pt")["input_ids"], max_new_tokens=2, shape_plan=plan)
        warm = time.perf_counter() - start
    graphs = sum(r["graphs"] for r in model.compile_stats())
    print(f"first call: {graphs_line(model.compile_stats(), loading.answered, warm)}")
    rows = []
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        print(f"> {prompt}", end="", flush=True)
        start = time.perf_counter()
        out = model.generate(
            input_ids=ids,
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            shape_plan=plan,
            streamer=TextStreamer(tok, skip_prompt=True, skip_special_tokens=True),
        )
        rows.append((prompt, out.shape[1] - ids.shape[1], time.perf_counter() - start))
    more = sum(r["graphs"] for r in model.compile_stats()) - graphs
    width = max(len(p) for p in PROMPTS)
    print(f"\n{'prompt':<{width}}  {'new tokens':>10}  {'time':>8}  {'tokens/s':>8}")
    for prompt, new, seconds in rows + [("all", sum(r[1] for r in rows), sum(r[2] for r in rows))]:
        print(f"{prompt:<{width}}  {new:>10}  {duration(seconds):>8}  {new / seconds:>8.0f}")
    print(
        "no prompt compiled a graph: every shape was in the plan"
        if not more
        else f"{more} more graph(s) compiled while answering"
    )
    demo.results["generated"] = rows


# ---- 6. chat ------------------------------------------------------------------------------------
CHAT_DIR = os.path.join(DEMO, "chat")


def chat_trained(demo: Demo) -> bool:
    return os.path.exists(os.path.join(CHAT_DIR, "model.safetensors")) and demo.trained


def chat(demo: Demo) -> None:
    from demo_chat import STEPS, chat_stage

    demo.results["chat"] = chat_stage(MODEL_DIR, CHAT_DIR, steps=min(STEPS, demo.args.steps), answer=False)


# ---- 7. serve ------------------------------------------------------------------------------------
def serve(demo: Demo) -> None:
    import concurrent.futures

    import httpx
    import openai
    from demo_chat import conversations, questions

    from staticformers import AutoModelForCausalLM, AutoTokenizer, ShapePlan
    from staticformers.backends.devices import default_backend
    from staticformers.compilation.progress import CompileProgress
    from staticformers.serving.server import ServeOptions, Server, build_loop, build_state
    from staticformers.utils.durations import duration

    model = AutoModelForCausalLM.from_pretrained(CHAT_DIR, device_map="auto")
    tok = AutoTokenizer.from_pretrained(CHAT_DIR)
    options = ServeOptions(model=CHAT_DIR, served_model_name="demo-chat", max_batch_size=4, precompile=True)
    # one decode shape for any four requests: a four-slot batch over a 256-position cache
    plan = ShapePlan(batch_sizes=[4], prompt_lengths=[32], kv_lengths=[256], max_model_len=256)
    start = time.perf_counter()
    rows = []
    announce = CompileProgress(
        plan.num_shapes, default_backend(model.device), write=lambda line: print(line, flush=True)
    )
    announce.begin()
    loop = build_loop(model, options, progress=lambda row: (rows.append(row), announce(row)), plan=plan)
    print(
        f"compiled the serving plan: {sum(r['graphs'] for r in rows)} graphs for {len(rows)} shapes "
        f"({sum(r['cache_hit'] for r in rows)} from the on-disk cache) in {time.perf_counter() - start:.1f} s"
    )
    asked = questions()
    with Server(build_state(model, tok, loop, options)) as server:
        print(f'serving {shown(CHAT_DIR)} as "demo-chat" on {server.url}; {len(asked)} questions at once')

        def compiled_so_far() -> float:  # staticformers:graphs_compiled_total counts from start, the plan included
            return sum(
                float(line.rsplit(" ", 1)[1])
                for line in httpx.get(server.url + "/metrics", timeout=60).text.splitlines()
                if line.startswith("staticformers:graphs_compiled_total")
            )

        compiled_before = compiled_so_far()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="demo", timeout=600, max_retries=0)

        def ask(question: str, stream: bool):
            begin = time.perf_counter()
            kw = dict(model="demo-chat", messages=[{"role": "user", "content": question}], max_tokens=48, temperature=0)
            if stream:
                pieces = [
                    c.choices[0].delta.content or ""
                    for c in client.chat.completions.create(**kw, stream=True)
                    if c.choices
                ]
                return "".join(pieces), f"streamed in {len(pieces)} chunks", time.perf_counter() - begin
            r = client.chat.completions.create(**kw)
            return r.choices[0].message.content, f"{r.usage.completion_tokens} tokens", time.perf_counter() - begin

        with concurrent.futures.ThreadPoolExecutor(len(asked)) as pool:
            answers = list(pool.map(ask, [q for q, _, _ in asked], [i == 0 for i in range(len(asked))]))
        trained_questions = {m["messages"][0]["content"] for m in conversations()[0]}
        exact = {True: [], False: []}  # trained question or not -> answered exactly as the docs say
        for (question, _, docs), (answer, how, seconds) in zip(asked, answers):
            answer = answer.strip()
            trained = question in trained_questions
            exact[trained].append(answer == docs)
            print(
                f"  Q: {question}   ({'as trained' if trained else 'a phrasing training never saw'})\n"
                f"  A: {answer}   ({how}, {duration(seconds)})" + ("" if answer == docs else f"\n     docs: {docs}")
            )
        text = httpx.get(server.url + "/metrics", timeout=60).text

        def value(name: str) -> float:
            return sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith(f"staticformers:{name}") and not line.startswith("#")
            )

        probe = (
            "got the docs' answer too: the answer follows the statement the question names, whatever words surround it"
            if all(exact[False])
            else "did not get the docs' answer: the model learned these "
            "question-answer pairs, not what the words around the statement mean"
        )
        print(
            f"{sum(exact[True])} of {len(exact[True])} trained questions answered exactly as the docs say; the new "
            f"phrasing {probe}."
        )
        print(
            f"metrics: {value('request_success_total'):.0f} "
            f"requests finished, {value('prompt_tokens_total'):.0f} prompt and "
            f"{value('generation_tokens_total'):.0f} generated tokens, time to first token "
            f"{duration(value('time_to_first_token_seconds_sum') / max(value('time_to_first_token_seconds_count'), 1))} "
            f"on average, {value('graphs_compiled_total') - compiled_before:.0f} graphs compiled while serving"
        )
    print("server stopped")
    demo.results["served"] = answers


STAGES = [
    Stage("devices", 'the devices here and the one "auto" picks', devices),
    Stage("tokenizer", "a byte-level BPE tokenizer trained on pydoc_data.topics", tokenizer, skip=lambda d: d.trained),
    Stage("train", "a small Qwen3 trained from scratch on the same text", train, skip=lambda d: d.trained),
    Stage("compile", "the shape plan compiled ahead of time into the on-disk cache", compile_plan),
    Stage("generate", "answers streamed from the trained model", generate),
    Stage(
        "chat",
        "fine-tuned on Q&A conversations with assistant-only loss, then evaluated",
        chat,
        skip=chat_trained,
        reuses=CHAT_DIR,
    ),
    Stage("serve", "an OpenAI-compatible server on the chat model, four questions at once", serve),
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--steps", type=int, default=400, help="training steps (default 400)")
    parser.add_argument("--retrain", action="store_true", help="train again even when .demo/model exists")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="compile the training step too (two graphs; costs a compile of tens of seconds on a small CPU)",
    )
    demo = Demo(parser.parse_args(argv))
    for n, stage in enumerate(STAGES, 1):
        header = f"[{n}/{len(STAGES)}] {stage.name}: {stage.what}"
        if stage.skip(demo):
            print(f"\n{header} -- skipped: reusing {shown(stage.reuses)} (--retrain to train again)")
            continue
        print(f"\n{header}  (at {time.perf_counter() - demo.start:.0f} s since the demo started)", flush=True)
        stage.run(demo)
    print(f"\ndemo done in {time.perf_counter() - demo.start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
