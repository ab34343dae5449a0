"""Starting and stopping the server: load the model, plan its shapes, compile, run HTTP.

`serve(options)` is what `staticformers serve PATH` runs. Under torchrun with
`--tensor-parallel-size N` every rank loads its shards (`DistributedConfig(tp_size=N)`); rank 0 serves
HTTP and the others follow its steps (`replication.py`). `Server` runs the same HTTP server in a
background thread of the calling process (tests, the demo) and stops it on `stop()`.

Shutdown: SIGTERM or Ctrl-C stop accepting connections, let in-flight requests finish for up to
`grace` seconds (uvicorn's graceful shutdown while the engine thread keeps generating), abort what is
left (each answer ends with finish_reason "abort" and `[DONE]`; a second Ctrl-C aborts at once), stop
the engine and exit 0 (uvicorn would re-raise the signal after its shutdown, ending the
process with the signal's status; this server treats the signal as the normal way to stop).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

logger = logging.getLogger("staticformers")


RUNTIME_LORA_RANK = 16  # --max-lora-rank's default with run-time adapter updates (vLLM's)


@dataclass
class ServeOptions:
    """Everything `staticformers serve` takes (see `commands/serve.py` for each flag's meaning)."""

    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch_size: int = 8
    max_model_len: Optional[int] = None
    dtype: Optional[str] = None
    device: str = "auto"
    api_key: Optional[str] = None
    max_queued_requests: int = 256
    served_model_name: Optional[str] = None
    chat_template: Optional[str] = None
    precompile: Optional[bool] = None  # None: the device's default (on for Neuron and XLA, off for CPU and CUDA)
    backend: Optional[str] = None
    no_compile: bool = False
    tensor_parallel_size: int = 1
    grace: float = 30.0
    max_body_bytes: int = 4 * 2**20
    max_grammar_bytes: int = 64 * 2**10  # the largest constraint (schema, regex, choices, grammar) compiled
    lora_modules: dict = field(default_factory=dict)  # adapter name -> PEFT folder (a request's `model` picks one)
    max_loras: Optional[int] = None  # adapters the bank has room for (default: as many as --lora-modules)
    max_lora_rank: Optional[int] = None  # the largest rank it holds (default: the largest given)
    enable_lora_runtime_updates: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    lora_root: Optional[str] = None  # the folder run-time loads must come from (None: every path refused)
    precompile_prompt_logprobs: bool = False  # the warm-up also compiles the scoring prefills (echo with logprobs)
    responses_store_size: int = 1024  # /v1/responses kept for previous_response_id (oldest evicted first)
    speculative_config: Optional[object] = None  # vLLM's --speculative-config: a JSON object (str) or a dict
    reasoning_parser: Optional[str] = None  # vLLM's --reasoning-parser: "qwen3" splits <think>...</think> out
    enable_chunked_prefill: bool = False  # prompts longer than a chunk run in chunks, the running rows decoding in them
    max_num_batched_tokens: Optional[int] = None  # a chunk step's tokens: its chunk width times its batch bucket
    enable_prefix_caching: bool = False  # prompt prefixes' keys and values kept and copied into joining rows
    prefix_cache_blocks: int = 512  # the pool's blocks (least recently used evicted)
    block_size: int = 32  # tokens per block (prefix blocks, KV blocks)
    num_gpu_blocks_override: Optional[int] = None  # KV blocks of the pool (block caches); see `kv_budget.py`
    kv_cache_memory_bytes: Optional[int] = None  # the pool's byte budget
    gpu_memory_utilization: Optional[float] = None  # the pool's share of the device's available memory

    @property
    def block_caches(self) -> bool:
        """Whether the KV cache is a pool of blocks (one of its three sizes given)."""
        return any(
            v is not None
            for v in (self.num_gpu_blocks_override, self.kv_cache_memory_bytes, self.gpu_memory_utilization)
        )


def sampling_defaults(model) -> dict:
    """The checkpoint's generation_config.json sampling values (vLLM's defaults), where it sets them."""
    gc = model.generation_config
    out = {}
    if gc is not None:
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            value = getattr(gc, name, None)
            if value is not None:
                out[name] = value
    return out


def stop_ids(model, tokenizer) -> list[int]:
    """Every id that ends an answer: the generation config's, the model config's and the tokenizer's EOS."""
    ids: list[int] = []
    for source in (
        getattr(model.generation_config, "eos_token_id", None),
        model.config.eos_token_id,
        tokenizer.eos_token_id,
    ):
        if source is None:
            continue
        ids += [int(source)] if isinstance(source, int) else [int(v) for v in source]
    return list(dict.fromkeys(ids))


def load(options: ServeOptions):
    """The tokenizer and the model (partitioned over the torchrun job with tensor parallel)."""
    from ..adapters.lora import RESERVED
    from ..api.auto import from_pretrained
    from ..tokenization.tokenizer import AutoTokenizer

    for name in options.lora_modules:
        if name in RESERVED:
            raise ValueError(
                f"The adapter name {name!r} in --lora-modules is reserved: {RESERVED[name]}. Pick another name."
            )
    tokenizer = AutoTokenizer.from_pretrained(options.model)
    kwargs = {}
    if options.tensor_parallel_size > 1:
        from ..distributed.distributed_config import DistributedConfig

        kwargs["distributed_config"] = DistributedConfig(tp_size=options.tensor_parallel_size)
    model = from_pretrained(options.model, dtype=options.dtype, device_map=options.device, **kwargs)
    if options.lora_modules or options.enable_lora_runtime_updates:
        # stacked in one bank: a decode batch mixes rows of every adapter (adapters/bank.py); with run-time
        # updates it covers every projection, with room for --max-loras adapters of rank --max-lora-rank
        from ..adapters.bank import bank_for_files

        runtime = options.enable_lora_runtime_updates
        bank_for_files(
            model,
            options.lora_modules,
            options.max_loras or (max(len(options.lora_modules), 1) if runtime else None),
            options.max_lora_rank or (RUNTIME_LORA_RANK if runtime else None),
            target_modules="all-linear" if runtime else None,
        )
    return model, tokenizer


def serving_plan(model, options: ServeOptions):
    """The shape plan `--max-model-len` and `--max-batch-size` give, completed for the model."""
    from ..generation.plan import ShapePlan

    plan = ShapePlan(max_model_len=options.max_model_len, max_batch_size=options.max_batch_size)
    plan = plan.bind(model.config.max_position_embeddings)
    if options.enable_chunked_prefill or options.enable_prefix_caching or options.block_caches:
        from ..generation.chunking import serving_chunk_tokens

        plan = plan.with_chunk_tokens(serving_chunk_tokens(plan, options.max_num_batched_tokens))
    return plan


class PrecompileBar:
    """`--precompile`'s progress: a bar over the plan's shapes (`total`), each shape's kind, size and seconds
    beside it, and a line before each shape saying which it is and how long the rest should take
    (`compilation/progress.py`); its last line is printed once, by `close()`."""

    def __init__(self, total: int, file=None, backend: str = ""):
        from tqdm.auto import tqdm

        from ..compilation.progress import CompileProgress

        self.bar = tqdm(desc="compiling the shape plan", unit="shape", total=total, file=file)
        self.progress = CompileProgress(total, backend, write=lambda line: self.bar.write(line, file=file))
        self.progress.begin()

    def __call__(self, row: dict) -> None:
        self.progress(row)
        self.bar.set_postfix_str(f"{row['kind']} {row['shape']} {row['seconds']:.1f} s", refresh=False)
        if self.bar.n + 1 < self.bar.total:
            self.bar.update(1)
        else:  # the last shape: close() draws the final line (an update would draw it first, then close again)
            self.bar.n = self.bar.total

    def close(self) -> None:
        self.bar.close()


def precompiles(backend, options: ServeOptions) -> bool:
    """Whether the server compiles its plan before traffic: `--precompile` / `--no-precompile`, else the
    device's default (`Backend.precompile_by_default`: Neuron and XLA, whose first request would otherwise
    pay a compile)."""
    if options.no_compile:
        return False
    return options.precompile if options.precompile is not None else bool(backend.precompile_by_default)


def build_loop(model, options: ServeOptions, progress=None, plan=None):
    """The engine's plan (`plan`, or the one `--max-model-len` and `--max-batch-size` give) and compile
    settings, and the generation loop; the whole plan compiled first with `precompile` (`progress(row)`
    after each shape)."""
    from ..generation.engines import compile_settings, engine_for
    from ..generation.generation_config import CompileConfig, GenerationConfig
    from ..generation.loop import GenerationLoop
    from ..generation.chunking import chunk_width, widest_steps
    from ..generation.kv_blocks import window_spec
    from .kv_budget import kv_blocks

    plan = plan or serving_plan(model, options)
    config = GenerationConfig(disable_compile=options.no_compile)
    compile_config = CompileConfig(backend=options.backend)
    speculator = speculative(model, options, config, compile_config)
    if speculator is not None:
        plan = speculator.plan_for(plan)  # its verify step is a shape of the plan, precompiled with the rest
    engine = engine_for(model, plan)
    settings = compile_settings(model, config, compile_config)

    def window(n: int):  # a mixed model's window layers' pool beside n blocks, the loop's (block caches chunk)
        slots = min(options.max_batch_size or plan.batch_sizes[-1], plan.batch_sizes[-1])
        steps = widest_steps(plan, chunk_width(plan, None), True)  # the loop chunks by the plan's budget
        ahead = speculator.width if speculator is not None else 1
        return window_spec(model.config, n, slots, steps, plan.max_model_len, options.block_size, ahead)

    blocks = kv_blocks(
        model,
        options.num_gpu_blocks_override,
        options.kv_cache_memory_bytes,
        options.gpu_memory_utilization,
        options.block_size,
        engine.tp,
        window,
    )
    # the loop first: it tells the engine its caches' kind (a mixed model's window layers' pool included), which the
    # precompiled steps then hold
    loop = GenerationLoop(
        engine,
        settings,
        max_batch_size=options.max_batch_size,
        speculator=speculator,
        # the plan's width; block caches resume a preempted request in chunks
        chunked_prefill=True if options.enable_chunked_prefill or blocks else None,
        prefix_caching=options.enable_prefix_caching,
        prefix_cache_blocks=options.prefix_cache_blocks,
        prefix_block_size=options.block_size,
        kv_blocks=blocks,
        kv_block_size=options.block_size,
    )
    if precompiles(engine.backend, options) and settings.enabled:
        engine.precompile(settings, progress=progress, scores=options.precompile_prompt_logprobs)
        draft = getattr(speculator.proposer, "engine", None) if speculator is not None else None
        if draft is not None:
            draft.precompile(speculator.proposer.settings, speculator.proposer.plan_for(plan))
    return loop


def speculative(model, options: ServeOptions, config, compile_config):
    """The loop's `Speculator` from `--speculative-config` (its draft model loaded like the model), or None."""
    if options.speculative_config is None:
        return None
    from ..api.auto import from_pretrained
    from ..generation.engines import compile_settings, engine_for
    from ..api.speculative import parse_speculative_config, speculator_from_config

    parsed = parse_speculative_config(options.speculative_config)
    draft = None
    if parsed["model"] is not None:
        draft = from_pretrained(parsed["model"], dtype=options.dtype, device_map=str(model.device))
    return speculator_from_config(
        model, parsed, lambda d: (engine_for(d), compile_settings(d, config, compile_config)), draft
    )


def build_state(model, tokenizer, loop, options: ServeOptions, replicator=None):
    """The HTTP side's state and the started engine thread."""
    from .state import ServerState
    from .engine_thread import EngineThread
    from .metrics import ServerMetrics
    from .reasoning import check_parser
    from .response_store import ResponseStore

    name = options.served_model_name or os.path.basename(os.path.normpath(options.model))
    if name in options.lora_modules:
        raise ValueError(
            f"The adapter name {name!r} is the base model's served name: give the adapter another name "
            f"in --lora-modules (or the base another --served-model-name)."
        )
    if options.api_key is not None and not options.api_key.strip():
        raise ValueError(
            "The API key is empty, which would leave the server open to anyone: pass a key, or None to "
            "serve without one."
        )
    chat_template = None
    if options.chat_template:
        with open(options.chat_template, encoding="utf-8") as f:
            chat_template = f.read()
        check_chat_template(tokenizer, chat_template, options.chat_template)
    metrics = ServerMetrics(name)
    engine = EngineThread(loop, metrics, options.max_queued_requests, replicator).start()
    return ServerState(
        model_name=name,
        tokenizer=tokenizer,
        engine=engine,
        metrics=metrics,
        max_model_len=loop.plan.max_model_len,
        max_n=loop.max_slots,
        defaults=sampling_defaults(model),
        eos_token_ids=stop_ids(model, tokenizer),
        api_key=options.api_key,
        chat_template=chat_template,
        max_body_bytes=options.max_body_bytes,
        max_grammar_bytes=options.max_grammar_bytes,
        reasoning_parser=check_parser(options.reasoning_parser),
        adapters=dict(options.lora_modules),
        responses=ResponseStore(options.responses_store_size),
        runtime_lora=options.enable_lora_runtime_updates,
        lora_root=os.path.realpath(options.lora_root) if options.lora_root else None,
    )


def check_chat_template(tokenizer, template: str, path: str) -> None:
    """Refuse at start-up a `--chat-template` that cannot render a one-message chat, rather than answer every
    chat request with a 400 that blames the client's messages."""
    try:
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], chat_template=template, add_generation_prompt=True, tokenize=False
        )
    except Exception as err:  # a syntax error, an undefined name, a raise_exception: the template's fault
        raise ValueError(
            f"--chat-template {path} cannot render a chat of one user message: {err}"
            + (
                ""
                if "fix the template" in str(err)
                else " (fix the template, or leave the flag out to use the tokenizer's)."
            )
        ) from None


DRAIN_MARGIN = 5  # seconds uvicorn waits past --grace for the aborted answers to send their last chunk


def _uvicorn_server(app, grace: float, engine):
    """(`engine`: the engine thread, or a callable giving it once it exists.)"""
    """uvicorn's server, whose shutdown drains the engine at the same time: the engine gives the running
    requests `grace` seconds, then aborts what is left, so every answer still ends as OpenAI's do (a last
    chunk with finish_reason "abort", then `[DONE]`) before uvicorn, waiting `grace + DRAIN_MARGIN`,
    would cut a connection. A second signal aborts at once (the answers still end cleanly); a third
    exits without waiting."""
    import uvicorn

    class _Server(uvicorn.Server):
        exits = 0

        def handle_exit(self, sig, frame):  # stop gracefully, then exit 0 (see the module docstring)
            self.exits += 1
            running = engine() if callable(engine) else engine
            if self.exits <= 2 and running is not None:
                threading.Thread(
                    target=running.shutdown,
                    args=(grace if self.exits == 1 else 0.0,),
                    daemon=True,
                    name="staticformers-drain",
                ).start()
            elif self.exits > 2:
                self.force_exit = True
            self.should_exit = True

    config = uvicorn.Config(
        app,
        log_level="warning",
        timeout_graceful_shutdown=int(math.ceil(grace)) + DRAIN_MARGIN,
        lifespan="off",
        access_log=False,
    )
    return _Server(config)


def bind(host: str, port: int) -> socket.socket:
    """The listening socket (port 0: any free one), bound before the server starts so its address is known."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto given explicitly: asyncio sets TCP_NODELAY on accepted connections only when their proto says
    # TCP, and without it each response's body waits for the client's delayed ACK (tens of milliseconds)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise OSError(f"Cannot listen on {host}:{port} ({err.strerror}): pick another --port or --host.") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class Server:
    """The HTTP server in a background thread of this process: `start()` returns its base URL."""

    def __init__(self, state, host: str = "127.0.0.1", port: int = 0, grace: float = 5.0):
        from .app import create_app

        self.state, self.grace = state, grace
        self.sock = bind(host, port)
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.server = _uvicorn_server(create_app(state), grace, state.engine)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True, name="staticformers-http"
        )

    def start(self, timeout: float = 30.0) -> str:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("The HTTP server did not start.")
            time.sleep(0.01)
        return self.url

    def stop(self) -> None:
        self.server.handle_exit(signal.SIGTERM, None)  # the drain a signal starts
        self.thread.join(timeout=self.grace + DRAIN_MARGIN + 10)
        self.state.engine.shutdown(self.grace)
        self.sock.close()

    def __enter__(self) -> "Server":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _precompile_bar(model, plan, options: ServeOptions) -> Optional[PrecompileBar]:
    """The warm-up's progress bar over every shape it compiles, or None when the plan is not compiled first
    (`--no-precompile`, or the device's default; `--no-compile`)."""
    from ..backends import for_device

    if not precompiles(for_device(model.device), options):
        return None
    from ..backends.devices import default_backend

    return PrecompileBar(
        plan.num_shapes + (len(plan.prefill_shapes()) if options.precompile_prompt_logprobs else 0),
        backend=options.backend or default_backend(model.device),
    )


def serve(options: ServeOptions) -> int:
    """Run the server until SIGTERM / Ctrl-C (every rank under torchrun); returns the exit code. One process
    binds its port before loading and answers 503 with the reason until it is ready (`starting.py`)."""
    if options.tensor_parallel_size > 1:
        return _serve_distributed(options)
    from .app import create_app
    from .starting import Starting

    sock = bind(options.host, options.port)
    host, port = sock.getsockname()[:2]
    starting = Starting(f"loading {options.model}" + (", then compiling its shape plan" if options.precompile else ""))
    box: dict = {}

    def prepare():  # in a thread: the port already answers
        try:
            model, tokenizer = load(options)
            plan = serving_plan(model, options)
            bar = _precompile_bar(model, plan, options)
            loop = build_loop(model, options, bar, plan=plan)
            if bar is not None:
                bar.close()
            state = box["state"] = build_state(model, tokenizer, loop, options)
            starting.ready(create_app(state))
            print(
                f"staticformers: serving {state.model_name} on http://{host}:{port} ({loop.max_slots} slots, "
                f"max_model_len {loop.plan.max_model_len}, {model.device})",
                flush=True,
            )
            _say_compile_note(options, loop)
        except BaseException as err:  # told by the main thread, after the server stops
            box["error"] = err
            server.should_exit = True

    server = _uvicorn_server(starting, options.grace, lambda: getattr(box.get("state"), "engine", None))
    print(f"staticformers: listening on http://{host}:{port} (503 until the model is ready)", flush=True)
    threading.Thread(target=prepare, name="staticformers-load", daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        if "state" in box:
            box["state"].engine.shutdown(options.grace)
        sock.close()
    if "error" in box:
        raise box["error"]
    print("staticformers: stopped", flush=True)
    return 0


def _serve_distributed(options: ServeOptions) -> int:
    """`serve` under torchrun: every rank loads its shards; rank 0 then serves HTTP (the others follow its
    steps, `replication.py`)."""
    import torch

    torch.manual_seed(0)  # rows without a seed draw the same on every rank (replication.py)
    model, tokenizer = load(options)
    rank = torch.distributed.get_rank()
    plan = serving_plan(model, options)
    bar = _precompile_bar(model, plan, options) if rank == 0 else None
    loop = build_loop(model, options, bar, plan=plan)
    if bar is not None:
        bar.close()
    if rank != 0:
        from .replication import Follower

        # the other ranks stop when rank 0 says so (after its graceful shutdown), not on their own signal
        # (a terminal's Ctrl-C reaches every rank; torchrun forwards SIGTERM to every rank)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        Follower(loop).run()
        return _finish(True, model)
    from .replication import Replicator

    state = build_state(model, tokenizer, loop, options, Replicator())
    from .app import create_app

    sock = bind(options.host, options.port)
    host, port = sock.getsockname()[:2]
    server = _uvicorn_server(create_app(state), options.grace, state.engine)
    print(
        f"staticformers: serving {state.model_name} on http://{host}:{port} "
        f"({loop.plan.batch_sizes[-1] if loop.max_slots is None else loop.max_slots} slots, "
        f"max_model_len {loop.plan.max_model_len}, {model.device})",
        flush=True,
    )
    _say_compile_note(options, loop)
    try:
        server.run(sockets=[sock])
    finally:
        state.engine.shutdown(options.grace)
        sock.close()
    print("staticformers: stopped", flush=True)
    return _finish(True, model)


def compile_note(options: ServeOptions, loop) -> Optional[str]:
    """What a server that did not precompile will do on its first requests (they wait while their shapes
    compile), or None when nothing compiles while serving."""
    plan = loop.plan
    if options.no_compile or precompiles(loop.engine.backend, options):
        return None
    return (
        f"the shape plan ({plan.num_shapes} shapes at most) was not compiled ahead: a request whose shape is "
        f"new waits while it compiles (tens of seconds on a CPU); --precompile compiles them all before serving"
    )


def _say_compile_note(options: ServeOptions, loop) -> None:
    note = compile_note(options, loop)
    if note:
        print(f"staticformers: {note}", flush=True)


def _finish(distributed: bool, model) -> int:
    if distributed:
        from ..distributed import shutdown

        del model
        shutdown()
    return 0


__all__ = ["ServeOptions", "Server", "serve", "build_loop", "build_state", "compile_note", "load"]
