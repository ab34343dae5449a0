"""`staticformers generate PATH "prompt"`: stream a continuation (or a chat reply) to the terminal."""

from __future__ import annotations

import argparse
import os
import sys

from ..generation.streamers import TextStreamer, _ids_of
from ..utils.durations import duration
from .options import add_threads

HELP = "generate text from a prompt with the compiled engine, streaming it to the terminal"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="checkpoint folder or Hub id")
    p.add_argument("prompt", nargs="?", default=None, help="the prompt (read from stdin when omitted)")
    p.add_argument("--chat", action="store_true", help="treat the prompt as a user message (chat template)")
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="a Jinja chat template file, for --chat with a model that has none (or to replace its own)",
    )
    p.add_argument("--system", default=None, help="a system message (with --chat)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="at most this many new tokens (default 128)")
    p.add_argument("--min-new-tokens", type=int, default=None, help="no end-of-sequence before this many")
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (with --do-sample)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens")
    p.add_argument("--top-p", type=float, default=None, help="sample within this probability mass (nucleus)")
    p.add_argument("--min-p", type=float, default=None, help="drop tokens below min-p times the likeliest one")
    p.add_argument("--repetition-penalty", type=float, default=None, help="above 1 discourages repeating tokens")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    p.add_argument("--device", default="auto", help="auto (Neuron first), neuron, cuda, cpu, ...")
    add_threads(p)
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: the checkpoint's)")
    p.add_argument("--backend", default=None, help="torch.compile backend (default: the device's)")
    p.add_argument("--no-compile", action="store_true", help="run eagerly (disable_compile=True)")
    p.add_argument("--max-model-len", type=int, default=None, help="the plan's longest sequence")
    p.add_argument("--stats", action="store_true", help="print the graphs and timings to stderr afterwards")


def read_chat_template(path: str) -> str:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--chat-template {path} is not a file: pass a Jinja template file.")
    with open(path, encoding="utf-8") as f:
        return f.read()


def run(args: argparse.Namespace) -> int:
    import time

    from ..compilation.summary import CacheWatch, graphs_line
    from ..generation.generation_config import CompileConfig
    from ..generation.plan import ShapePlan
    from ..api.auto import from_pretrained
    from ..tokenization.tokenizer import AutoTokenizer
    from .options import check_backend, check_device

    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt.strip():
        raise ValueError("The prompt is empty: pass some text (or pipe it on stdin).")
    if args.chat_template and not args.chat:
        raise ValueError("--chat-template applies to --chat: add --chat, or drop --chat-template.")
    check_backend(args.backend)
    check_device(args.device)
    template = read_chat_template(args.chat_template) if args.chat_template else None
    tok = AutoTokenizer.from_pretrained(args.model)
    if args.chat and template is None and tok.chat_template is None:
        raise ValueError(
            f"{args.model} has no chat template: pass --chat-template FILE (a Jinja template), "
            f"or drop --chat to continue the prompt as plain text."
        )
    model = from_pretrained(args.model, dtype=args.dtype, device_map=args.device)
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": prompt}
        ]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", chat_template=template)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
    else:
        ids = tok(prompt, return_tensors="pt")["input_ids"]
    plan = ShapePlan(max_model_len=args.max_model_len) if args.max_model_len else None
    streamer = TerminalStreamer(tok, show_prompt=not args.chat, skip_special_tokens=True)
    start = time.perf_counter()
    with CacheWatch() as cache:
        if not args.no_compile:
            compile_first(model, plan, CompileConfig(backend=args.backend), ids.shape[1], args.max_new_tokens)
        model.generate(
            input_ids=ids,
            streamer=streamer,
            max_new_tokens=args.max_new_tokens,
            min_new_tokens=args.min_new_tokens,
            do_sample=args.do_sample,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            seed=args.seed,
            disable_compile=args.no_compile,
            compile_config=CompileConfig(backend=args.backend),
            shape_plan=plan,
            pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else None,
        )
    seconds = time.perf_counter() - start
    if args.stats:
        rows = model.compile_stats()
        first_calls = sum(r["first_call_seconds"] for r in rows)
        print(
            f"\n{streamer.new_tokens} new tokens in {duration(seconds)} on {model.device}; "
            f"{graphs_line(rows, cache.answered, first_calls)}",
            file=sys.stderr,
        )
        for row in rows:
            print(
                f"  {row['kind']:8s} {str(row['shape']):16s} {row['backend']:10s} graphs {row['graphs']} "
                f"(first call {duration(row['first_call_seconds'])}) calls {row['calls']}",
                file=sys.stderr,
            )
    return 0


def compile_first(model, plan, compile_config, prompt_len: int, max_new_tokens: int) -> None:
    """Build the shapes this one request needs (its prefill and decode steps) before generating, saying how
    many and how long the rest should take (`compilation/progress.py`) on stderr, so that the first token does
    not wait in silence; nothing is said when they are all built already. A request the plan refuses is left
    to `generate`, which says why."""
    from ..generation.engines import compile_settings, engine_for
    from ..compilation.progress import CompileProgress
    from ..generation.generation_config import GenerationConfig
    from ..generation.plan import PlanError, ShapePlan

    engine = engine_for(model)
    plan = plan.bind(model.config.max_position_embeddings) if plan is not None else engine.plan
    try:
        need = plan.positions_needed(prompt_len, max_new_tokens)
        kv, prompt = plan.kv_bucket(need), plan.prompt_bucket(prompt_len)
    except (PlanError, ValueError):
        return
    settings = compile_settings(model, GenerationConfig(), compile_config)
    if not settings.enabled or (engine.warm("decode", 1, kv, settings) and engine.warm("prefill", 1, prompt, settings)):
        return
    mine = ShapePlan(
        batch_sizes=[1],
        prompt_lengths=[prompt],
        kv_lengths=[kv],
        max_model_len=plan.max_model_len,
        linear_chunk=plan.linear_chunk,
    )
    progress = CompileProgress(
        mine.num_shapes,
        settings.backend,
        describe=lambda r: (
            f"  {r['kind']} {r['shape']}: {duration(r['seconds'])} "
            f"({'loaded from the on-disk cache' if r['cache_hit'] else 'compiled'})"
        ),
    )
    progress.begin()
    engine.precompile(settings, plan=mine.bind(model.config.max_position_embeddings), progress=progress)


class TerminalStreamer(TextStreamer):
    """`TextStreamer` that prints the prompt only with the first new token (so a refusal before
    generation starts prints the error alone) and counts the new tokens."""

    def __init__(self, tokenizer, show_prompt: bool, **decode_kwargs):
        super().__init__(tokenizer, skip_prompt=not show_prompt, **decode_kwargs)
        self._prompt = None  # the prompt ids, held until a token is generated
        self._started = False
        self.new_tokens = 0

    def put(self, value) -> None:
        if not self._started and self._prompt is None:
            self._prompt = value
            return
        self._release_prompt()
        self.new_tokens += len(_ids_of(value))
        super().put(value)

    def end(self) -> None:
        self._release_prompt()
        super().end()

    def _release_prompt(self) -> None:
        if not self._started:
            self._started = True
            super().put(self._prompt if self._prompt is not None else [])
