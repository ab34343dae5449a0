"""`POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter` (vLLM's routes and fields): LoRA adapters
added to and dropped from a running server, with `--enable-lora-runtime-updates`.

- **A load compiles nothing and pauses nothing.** The adapter's files are read and checked off the event
  loop, then its weights are written into a free slot of the model's adapter bank (`adapters/bank.py`):
  stacked tensors of fixed shape (`--max-loras` slots of rank `--max-lora-rank`), written in place. No
  row in flight reads a free slot, so running rows go on decoding; no graph depends on the bank's
  contents, so the graph count does not move. It is then listed by `/v1/models` and a request's `model`
  may name it.
- **An unload waits for its rows.** The name is withdrawn first (new requests naming it get a 404), then
  the slot is cleared once no submitted, waiting or running request uses it.
- **Refusals** (OpenAI's error JSON): updates not enabled (400), a path outside `--lora-root` or no
  root set (403), a name already loaded (409), a full bank (409: unload one first, or start with a
  larger `--max-loras`), a reserved name such as `__base__` (400: it means the base model), an adapter
  that does not fit (rank above `--max-lora-rank`, other layers: 400), an unknown name to unload (404). Both routes are under `/v1/`, behind the API key.
"""

from __future__ import annotations

import asyncio
import os

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from ...adapters.bank import AdapterBankError, bank_of
from ...adapters.files import read_adapter
from ...adapters.lora import RESERVED
from ..protocol import ApiError
from ..state import ServerState, read_body

POLL_SECONDS = 0.02  # how often an unload looks whether the adapter's last rows have finished


def register(app: FastAPI, state: ServerState) -> None:
    """Add these endpoints to `app`, their handlers reading `state`."""
    lock = asyncio.Lock()  # one load or unload at a time

    def enabled():
        if not state.runtime_lora:
            raise ApiError(
                400,
                "Adapters cannot be loaded or unloaded at run time here: start the server with "
                "--enable-lora-runtime-updates (and --lora-root).",
            )
        return bank_of(state.engine.loop.engine.model)

    def name_of(body) -> str:
        if not isinstance(body, dict):
            raise ApiError(400, "The request body must be a JSON object.")
        name = body.get("lora_name")
        if not isinstance(name, str) or not name.strip():
            raise ApiError(400, f"lora_name={name!r} must be a non-empty string.", param="lora_name")
        if name in RESERVED:
            raise ApiError(
                400, f"lora_name={name!r} is reserved: {RESERVED[name]}. Pick another name.", param="lora_name"
            )
        return name

    @app.post("/v1/load_lora_adapter")
    async def load(request: Request):
        bank = enabled()
        body = await read_body(state, request)
        name = name_of(body)
        path = body.get("lora_path")
        if not isinstance(path, str) or not path:
            raise ApiError(400, f"lora_path={path!r} must be the path of a PEFT adapter folder.", param="lora_path")
        root = state.lora_root
        real = os.path.realpath(path)
        if root is None:
            raise ApiError(
                403,
                "Adapters may be loaded only from under --lora-root, and this server has none: "
                "restart it with --lora-root FOLDER.",
                param="lora_path",
            )
        if not (real == root or real.startswith(root.rstrip(os.sep) + os.sep)):
            raise ApiError(
                403,
                f"lora_path={path!r} is outside --lora-root ({root}): put the adapter inside it.",
                param="lora_path",
            )
        if not os.path.isdir(real):
            raise ApiError(
                400,
                f"lora_path={path!r} is not a folder: pass a PEFT adapter folder under --lora-root.",
                param="lora_path",
            )
        async with lock:
            if name == state.model_name or name in state.adapters:
                raise ApiError(
                    409,
                    f"The adapter {name!r} is already loaded: unload it first, or pick another name.",
                    param="lora_name",
                )
            if len(bank.slots) >= bank.capacity:
                raise ApiError(
                    409,
                    f"The adapter bank is full ({bank.capacity} adapters, --max-loras): unload one "
                    f"first, or restart with a larger --max-loras.",
                    param="lora_name",
                )
            model = state.engine.loop.engine.model

            def read_and_put():
                config, weights = read_adapter(model, real)
                bank.put(name, {m: (w["A"], w["B"], config.scaling_for(m)) for m, w in weights.items()}, source=real)

            try:
                await asyncio.to_thread(read_and_put)
            except AdapterBankError as err:
                raise ApiError(400, str(err), param="lora_path") from None
            except (OSError, ValueError) as err:
                raise ApiError(400, f"The adapter at {path!r} could not be read: {err}", param="lora_path") from None
            state.adapters[name] = path
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload(request: Request):
        bank = enabled()
        name = name_of(await read_body(state, request))
        async with lock:
            if name not in state.adapters:
                raise ApiError(404, f"There is no adapter named {name!r} loaded here.", param="lora_name")
            del state.adapters[name]  # new requests naming it are refused from now on
            while state.engine.uses_adapter(name):
                await asyncio.sleep(POLL_SECONDS)
            bank.remove(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


__all__ = ["register"]
