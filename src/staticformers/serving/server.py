"""Starting and stopping the server: load the model, plan its shapes, compile, run HTTP.

`serve(options)` is what `staticformers serve PATH` runs. Under torchrun with
`--tensor-parallel-size N` every rank loads its shards (`DistributedConfig(tp_size=N)`); rank 0 serves
HTTP and the others follow its steps (`replication.py`). `Server` runs the same HTTP server in a
background thread of the calling process (tests, the demo) and stops it on `stop()`.

Shutdown: SIGTERM or Ctrl-C stop accepting connections, let in-flight requests finish for up to
`grace` seconds (uvicorn's graceful shutdown while the engine thread keeps generating), cancel what is
left, stop the engine and exit 0 (uvicorn would re-raise the signal after its shutdown, ending the
process with the signal's status; this server treats the signal as the normal way to stop).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

logger = logging.getLogger("staticformers")


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
    precompile: bool = False
    backend: Optional[str] = None
    no_compile: bool = False
    tensor_parallel_size: int = 1
    grace: float = 30.0
    max_body_bytes: int = 4 * 2**20
    lora_modules: dict = field(default_factory=dict)  # adapter name -> PEFT folder (a request's `model` picks one)
    max_loras: Optional[int] = None  # adapters the bank has room for (default: as many as --lora-modules)
    max_lora_rank: Optional[int] = None  # the largest rank it holds (default: the largest given)


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
    for source in (getattr(model.generation_config, "eos_token_id", None), model.config.eos_token_id,
                   tokenizer.eos_token_id):
        if source is None:
            continue
        ids += [int(source)] if isinstance(source, int) else [int(v) for v in source]
    return list(dict.fromkeys(ids))


def load(options: ServeOptions):
    """The tokenizer and the model (partitioned over the torchrun job with tensor parallel)."""
    from ..api.auto import from_pretrained
    from ..tokenization.tokenizer import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(options.model)
    kwargs = {}
    if options.tensor_parallel_size > 1:
        from ..distributed.distributed_config import DistributedConfig

        kwargs["distributed_config"] = DistributedConfig(tp_size=options.tensor_parallel_size)
    model = from_pretrained(options.model, dtype=options.dtype, device_map=options.device, **kwargs)
    if options.lora_modules:  # stacked in one bank: a decode batch mixes rows of every adapter (adapter_bank.py)
        from ..adapters.bank import bank_for_files

        bank_for_files(model, options.lora_modules, options.max_loras, options.max_lora_rank)
    return model, tokenizer


def serving_plan(model, options: ServeOptions):
    """The shape plan `--max-model-len` and `--max-batch-size` give, completed for the model."""
    from ..generation.plan import ShapePlan

    plan = ShapePlan(max_model_len=options.max_model_len, max_batch_size=options.max_batch_size)
    return plan.bind(model.config.max_position_embeddings)


class PrecompileBar:
    """`--precompile`'s progress: a bar over the plan's shapes (`total`), each shape's kind, size and seconds
    beside it; its last line is printed once, by `close()`."""

    def __init__(self, total: int, file=None):
        from tqdm.auto import tqdm

        self.bar = tqdm(desc="compiling the shape plan", unit="shape", total=total, file=file)

    def __call__(self, row: dict) -> None:
        self.bar.set_postfix_str(f"{row['kind']} {row['shape']} {row['seconds']:.1f} s", refresh=False)
        if self.bar.n + 1 < self.bar.total:
            self.bar.update(1)
        else:  # the last shape: close() draws the final line (an update would draw it first, then close again)
            self.bar.n = self.bar.total

    def close(self) -> None:
        self.bar.close()


def build_loop(model, options: ServeOptions, progress=None, plan=None):
    """The engine's plan (`plan`, or the one `--max-model-len` and `--max-batch-size` give) and compile
    settings, and the generation loop; the whole plan compiled first with `precompile` (`progress(row)`
    after each shape)."""
    from ..api.generate import compile_settings, engine_for
    from ..generation.generation_config import CompileConfig, GenerationConfig
    from ..generation.loop import GenerationLoop

    plan = plan or serving_plan(model, options)
    engine = engine_for(model, plan)
    settings = compile_settings(model, GenerationConfig(disable_compile=options.no_compile),
                                CompileConfig(backend=options.backend))
    if options.precompile and settings.enabled:
        engine.precompile(settings, progress=progress)
    return GenerationLoop(engine, settings, max_batch_size=options.max_batch_size)


def build_state(model, tokenizer, loop, options: ServeOptions, replicator=None):
    """The HTTP side's state and the started engine thread."""
    from .state import ServerState
    from .engine_thread import EngineThread
    from .metrics import ServerMetrics

    name = options.served_model_name or os.path.basename(os.path.normpath(options.model))
    if name in options.lora_modules:
        raise ValueError(f"The adapter name {name!r} is the base model's served name: give the adapter another name "
                         f"in --lora-modules (or the base another --served-model-name).")
    metrics = ServerMetrics(name)
    engine = EngineThread(loop, metrics, options.max_queued_requests, replicator).start()
    chat_template = None
    if options.chat_template:
        with open(options.chat_template, encoding="utf-8") as f:
            chat_template = f.read()
    return ServerState(model_name=name, tokenizer=tokenizer, engine=engine, metrics=metrics,
                       max_model_len=loop.plan.max_model_len, max_n=loop.max_slots,
                       defaults=sampling_defaults(model), eos_token_ids=stop_ids(model, tokenizer),
                       api_key=options.api_key, chat_template=chat_template, max_body_bytes=options.max_body_bytes,
                       adapters=dict(options.lora_modules))


def _uvicorn_server(app, grace: float):
    import uvicorn

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # stop gracefully, then exit 0 (see the module docstring)
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            else:
                self.should_exit = True

    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=int(max(grace, 1)), lifespan="off",
                            access_log=False)
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
        self.server = _uvicorn_server(create_app(state), grace)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="staticformers-http")

    def start(self, timeout: float = 30.0) -> str:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("The HTTP server did not start.")
            time.sleep(0.01)
        return self.url

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=self.grace + 10)
        self.state.engine.shutdown(self.grace)
        self.sock.close()

    def __enter__(self) -> "Server":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def serve(options: ServeOptions) -> int:
    """Run the server until SIGTERM / Ctrl-C (every rank under torchrun); returns the exit code."""
    import torch

    distributed = options.tensor_parallel_size > 1
    if distributed:
        torch.manual_seed(0)  # rows without a seed draw the same on every rank (replication.py)
    model, tokenizer = load(options)
    rank = torch.distributed.get_rank() if distributed else 0
    plan = serving_plan(model, options)
    bar = PrecompileBar(plan.num_shapes) if options.precompile and not options.no_compile and rank == 0 else None
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
        return _finish(distributed, model)
    replicator = None
    if distributed:
        from .replication import Replicator

        replicator = Replicator()
    state = build_state(model, tokenizer, loop, options, replicator)
    from .app import create_app

    sock = bind(options.host, options.port)
    host, port = sock.getsockname()[:2]
    server = _uvicorn_server(create_app(state), options.grace)
    print(f"staticformers: serving {state.model_name} on http://{host}:{port} "
          f"({loop.plan.batch_sizes[-1] if loop.max_slots is None else loop.max_slots} slots, "
          f"max_model_len {loop.plan.max_model_len}, {model.device})", flush=True)
    note = compile_note(options, plan)
    if note:
        print(f"staticformers: {note}", flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        state.engine.shutdown(options.grace)
        sock.close()
    print("staticformers: stopped", flush=True)
    return _finish(distributed, model)


def compile_note(options: ServeOptions, plan) -> Optional[str]:
    """What a server that did not precompile will do on its first requests (they wait while their shapes
    compile), or None when nothing compiles while serving."""
    if options.precompile or options.no_compile:
        return None
    return (f"the shape plan ({plan.num_shapes} shapes at most) was not compiled ahead: a request whose shape is "
            f"new waits while it compiles (tens of seconds on a CPU); --precompile compiles them all before serving")


def _finish(distributed: bool, model) -> int:
    if distributed:
        from ..distributed import shutdown

        del model
        shutdown()
    return 0


__all__ = ["ServeOptions", "Server", "serve", "build_loop", "build_state", "compile_note", "load"]
