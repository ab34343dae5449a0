"""`staticformers serve PATH`: an OpenAI-compatible server with continuous batching over fixed slots.

Needs the `serve` extra (`pip install -e '.[serve]'` in the checkout: FastAPI, uvicorn, prometheus_client).
Under torchrun with `--tensor-parallel-size N`, rank 0 serves HTTP and every rank runs the steps on
its shards: `torchrun --nproc_per_node=N -m staticformers serve PATH --tensor-parallel-size N`.
"""

from __future__ import annotations

import argparse
import os

from .options import add_threads

HELP = "serve a model over an OpenAI-compatible HTTP API (completions, chat, streaming, metrics)"
API_KEY_ENV = "STATICFORMERS_API_KEY"


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _size(text: str) -> int:
    from ..serving.kv_budget import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port number (0-65535; 0 picks a free one)")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="checkpoint folder or Hub id (with its tokenizer)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=_port, default=8000, help="port to listen on (default 8000; 0 picks a free one)")
    p.add_argument(
        "--max-batch-size",
        type=_positive,
        default=8,
        help="decode slots: requests generating at once, the plan's largest batch bucket (default 8)",
    )
    p.add_argument(
        "--max-model-len",
        type=_positive,
        default=None,
        help="longest prompt + answer in tokens (default: the model's positions, at most 2048)",
    )
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: the checkpoint's)")
    p.add_argument("--device", default="auto", help="auto (Neuron first), neuron, cuda, cpu, ...")
    add_threads(p)
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV}, else none)",
    )
    p.add_argument(
        "--max-queued-requests",
        type=_positive,
        default=256,
        help="requests that may wait for a slot; one more gets HTTP 429 (default 256)",
    )
    p.add_argument(
        "--served-model-name", default=None, help="the name clients pass as `model` (default: the folder's name)"
    )
    p.add_argument(
        "--chat-template", default=None, metavar="FILE", help="a .jinja chat template replacing the tokenizer's"
    )
    p.add_argument(
        "--precompile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compile the whole shape plan before accepting traffic (a progress bar shows it). Default: on "
        "for neuron and xla devices, where a graph compiles for minutes and a first request must not "
        "wait for one; off for cpu and cuda (each shape compiles on first use; --precompile to warm "
        "up anyway)",
    )
    p.add_argument(
        "--precompile-prompt-logprobs",
        action="store_true",
        help="the warm-up also compiles the scoring prefills (one per prefill shape) that completions with "
        "echo and logprobs run, as evaluation harnesses send them",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=_positive,
        default=1,
        help="shard the model over N ranks (run under torchrun --nproc_per_node=N)",
    )
    p.add_argument("--backend", default=None, help="torch.compile backend (default: the device's)")
    p.add_argument("--no-compile", action="store_true", help="run the steps eagerly")
    p.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='speculative decoding, with vLLM\'s keys: \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4}\' (prompt lookup) or \'{"model": PATH, "num_speculative_tokens": 4}\' '
        "(a draft model sharing the tokenizer)",
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="PEFT LoRA adapters served beside the base model, unmerged: a request whose `model` is NAME "
        "uses that adapter; one batch mixes rows of every adapter and of none",
    )
    p.add_argument(
        "--max-loras",
        type=_positive,
        default=None,
        help="adapters the server holds at once (default: as many as --lora-modules)",
    )
    p.add_argument(
        "--max-lora-rank",
        type=_positive,
        default=None,
        help="the largest adapter rank (default: the largest given; 16 with --enable-lora-runtime-updates)",
    )
    p.add_argument(
        "--enable-lora-runtime-updates",
        action="store_true",
        help="allow POST /v1/load_lora_adapter {lora_name, lora_path} and /v1/unload_lora_adapter "
        "{lora_name} (vLLM's): an adapter goes into a free slot of --max-loras without compiling "
        "anything or pausing running requests; an unload waits for the adapter's requests",
    )
    p.add_argument(
        "--lora-root",
        default=None,
        metavar="FOLDER",
        help="the folder run-time adapter loads must come from (default: none, every load refused)",
    )
    p.add_argument(
        "--max-grammar-bytes",
        type=int,
        default=64 * 2**10,
        metavar="N",
        help="the largest constraint a request may send (a JSON schema, regex, choice list or grammar, "
        "in bytes); its compile time grows faster than its size (default 65536)",
    )
    p.add_argument(
        "--responses-store-size",
        type=int,
        default=1024,
        metavar="N",
        help="responses of /v1/responses kept in memory for previous_response_id (store=true, OpenAI's "
        "default); one more evicts the oldest (default 1024; 0 keeps none)",
    )
    p.add_argument(
        "--reasoning-parser",
        default=None,
        choices=["qwen3"],
        help="split a chat answer's <think>...</think> into message.reasoning_content (and "
        "delta.reasoning_content when streaming), vLLM's flag; structured outputs then constrain "
        "only the answer after it",
    )
    p.add_argument(
        "--enable-chunked-prefill",
        action="store_true",
        help="run prompts longer than a chunk as chunks, in steps that also give each running request "
        "its next token (it waits at most one chunk per token; prompts longer than the largest "
        "prompt bucket run)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=_positive,
        default=None,
        metavar="N",
        help="tokens one chunk step computes (default 512): a chunk step's width is N over its batch bucket "
        "(at most the largest prompt bucket), since it runs every row of its batch; on block caches prompts "
        "chunk in a batch of their own, so one chunking alone takes N tokens a step",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action="store_true",
        help="keep prompt prefixes' keys and values on the device and copy them into requests that "
        "start the same way (hashed in blocks, per adapter)",
    )
    p.add_argument(
        "--prefix-cache-blocks",
        type=_positive,
        default=512,
        metavar="N",
        help="blocks the prefix cache holds (default 512; the least recently used is evicted)",
    )
    p.add_argument(
        "--block-size",
        type=_positive,
        default=32,
        metavar="TOKENS",
        help="tokens per block of the prefix cache and of the KV pool (default 32)",
    )
    p.add_argument(
        "--num-gpu-blocks-override",
        type=_positive,
        default=None,
        metavar="N",
        help="run on a pool of N KV blocks, each request holding the blocks its tokens fill, the newest "
        "preempted (and later resumed) when the pool runs out; turns chunked prefill on",
    )
    p.add_argument(
        "--kv-cache-memory-bytes",
        type=_size,
        default=None,
        metavar="SIZE",
        help="a KV pool of the blocks SIZE bytes hold (512MiB, 2GB): the way to size it on the CPU",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        metavar="F",
        help="a KV pool of F of the device's memory available after loading (a device that reports it)",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGTERM / Ctrl-C (default 30)",
    )


def lora_modules(values) -> dict:
    """NAME=PATH pairs as {name: path}; a malformed or repeated one is refused."""
    out: dict = {}
    for item in values or []:
        name, sep, path = item.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {item!r} is not NAME=PATH: write e.g. --lora-modules sql=./sql-lora.")
        if name in out:
            raise ValueError(f"--lora-modules names {name!r} twice: give each adapter its own name.")
        out[name] = path
    return out


def run(args: argparse.Namespace) -> int:
    from .options import check_backend, check_device

    check_backend(args.backend)
    check_device(args.device)
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        raise RuntimeError(
            f"staticformers serve needs the serve extra ({err.name} is missing): "
            f"pip install -e '.[serve]' in the staticformers checkout."
        ) from None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.tensor_parallel_size != world:
        raise ValueError(
            f"--tensor-parallel-size {args.tensor_parallel_size} needs as many processes, but {world} "
            f"{'is' if world == 1 else 'are'} running: launch with torchrun --nproc_per_node="
            f"{args.tensor_parallel_size} -m staticformers serve ... --tensor-parallel-size {args.tensor_parallel_size}."
        )
    adapters = lora_modules(args.lora_modules)
    if adapters and args.tensor_parallel_size > 1:
        raise ValueError(
            "--lora-modules with --tensor-parallel-size > 1 is not supported: serve in one process, or merge "
            "the adapter into the model (merge_and_unload) and serve that."
        )
    if args.enable_lora_runtime_updates and args.tensor_parallel_size > 1:
        raise ValueError(
            "--enable-lora-runtime-updates with --tensor-parallel-size > 1 is not supported: serve in one process."
        )
    if args.lora_root is not None and not os.path.isdir(args.lora_root):
        raise ValueError(f"--lora-root {args.lora_root!r} is not a folder: pass the folder adapters are loaded from.")
    if args.max_grammar_bytes < 1:
        raise ValueError(f"--max-grammar-bytes {args.max_grammar_bytes} must be at least 1 byte.")
    if args.responses_store_size < 0:
        raise ValueError(f"--responses-store-size {args.responses_store_size} must be 0 or more responses.")
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError(
            "--api-key is empty, which would leave the server open to anyone: pass a key, or leave the "
            "flag out to serve without one."
        )
    if args.speculative_config is not None:
        from ..api.speculative import parse_speculative_config

        parse_speculative_config(args.speculative_config)  # refused before anything loads
        if args.tensor_parallel_size > 1:
            raise ValueError(
                "--speculative-config with --tensor-parallel-size > 1 is not supported: serve in one process."
            )
    if args.grace < 0:
        raise ValueError(f"--grace {args.grace} must be 0 or more seconds.")
    if args.chat_template is not None and not os.path.isfile(args.chat_template):
        raise ValueError(f"--chat-template {args.chat_template!r} is not a file: pass a .jinja template file.")
    from ..serving.server import ServeOptions, serve

    options = ServeOptions(
        model=args.model,
        host=args.host,
        port=args.port,
        max_batch_size=args.max_batch_size,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        device=args.device,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        max_queued_requests=args.max_queued_requests,
        served_model_name=args.served_model_name,
        chat_template=args.chat_template,
        precompile=args.precompile,
        backend=args.backend,
        no_compile=args.no_compile,
        tensor_parallel_size=args.tensor_parallel_size,
        grace=args.grace,
        lora_modules=adapters,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        responses_store_size=args.responses_store_size,
        max_grammar_bytes=args.max_grammar_bytes,
        enable_lora_runtime_updates=args.enable_lora_runtime_updates,
        lora_root=args.lora_root,
        precompile_prompt_logprobs=args.precompile_prompt_logprobs,
        speculative_config=args.speculative_config,
        reasoning_parser=args.reasoning_parser,
        enable_chunked_prefill=args.enable_chunked_prefill,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        prefix_cache_blocks=args.prefix_cache_blocks,
        block_size=args.block_size,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    return serve(options)
