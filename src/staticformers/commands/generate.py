"""`staticformers generate PATH "prompt"`: stream a continuation (or a chat reply) to the terminal."""

from __future__ import annotations

import argparse
import sys

HELP = "generate text from a prompt with the compiled engine, streaming it to the terminal"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="checkpoint folder or Hub id")
    p.add_argument("prompt", nargs="?", default=None, help="the prompt (read from stdin when omitted)")
    p.add_argument("--chat", action="store_true", help="treat the prompt as a user message (chat template)")
    p.add_argument("--system", default=None, help="a system message (with --chat)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--min-new-tokens", type=int, default=None)
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    p.add_argument("--device", default="auto", help="auto (Neuron first), neuron, cuda, cpu, ...")
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: the checkpoint's)")
    p.add_argument("--backend", default=None, help="torch.compile backend (default: the device's)")
    p.add_argument("--no-compile", action="store_true", help="run eagerly (disable_compile=True)")
    p.add_argument("--max-model-len", type=int, default=None, help="the plan's longest sequence")
    p.add_argument("--stats", action="store_true", help="print the graphs and timings to stderr afterwards")


def run(args: argparse.Namespace) -> int:
    import time

    from ..generation.config import CompileConfig
    from ..generation.plan import ShapePlan
    from ..generation.streamers import TextStreamer
    from ..auto import from_pretrained
    from ..tokenizer import AutoTokenizer

    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt.strip():
        raise ValueError("The prompt is empty: pass some text (or pipe it on stdin).")
    tok = AutoTokenizer.from_pretrained(args.model)
    model = from_pretrained(args.model, dtype=args.dtype, device_map=args.device)
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
            [{"role": "user", "content": prompt}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
    else:
        ids = tok(prompt, return_tensors="pt")["input_ids"]
    plan = ShapePlan(max_model_len=args.max_model_len) if args.max_model_len else None
    streamer = TextStreamer(tok, skip_prompt=args.chat, skip_special_tokens=True)
    start = time.perf_counter()
    out = model.generate(
        input_ids=ids, streamer=streamer, max_new_tokens=args.max_new_tokens, min_new_tokens=args.min_new_tokens,
        do_sample=args.do_sample, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, seed=args.seed, disable_compile=args.no_compile,
        compile_config=CompileConfig(backend=args.backend), shape_plan=plan,
        pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else None,
    )
    seconds = time.perf_counter() - start
    if args.stats:
        new = out.shape[1] - ids.shape[1]
        print(f"\n{new} tokens in {seconds:.2f} s on {model.device}", file=sys.stderr)
        for row in model.compile_stats():
            print(f"  {row['kind']:8s} {str(row['shape']):16s} {row['backend']:10s} compiled {row['graphs']} "
                  f"({row['first_call_seconds']:.2f} s) calls {row['calls']}", file=sys.stderr)
    return 0
