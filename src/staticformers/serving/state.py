"""What every HTTP handler shares: the server's state, the body read within its size limit, the check of a
request's `model`, and OpenAI's error JSON as a response.

Kept apart from the routes so that each route module (`serving/routes/`) and the guard in `app.py` read
the same limits and refuse in the same words.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from fastapi import Request
from fastapi.responses import JSONResponse

from .engine_thread import EngineThread
from .metrics import ServerMetrics
from .protocol import ApiError
from .response_store import ResponseStore

DEFAULT_MAX_BODY_BYTES = 4 * 2**20
DEFAULT_MAX_GRAMMAR_BYTES = 64 * 2**10  # a constraint's text (schema, regex, choices, grammar), compiled off the loop
MAX_DEPTH = 64  # levels of JSON nesting a body may have (OpenAI's own schemas allow far fewer)


@dataclass
class ServerState:
    """What the handlers need: the model's name and tokenizer, the engine thread and its loop, limits."""

    model_name: str
    tokenizer: Any
    engine: EngineThread
    metrics: ServerMetrics
    max_model_len: int
    max_n: int
    defaults: dict = field(default_factory=dict)  # sampling defaults (generation_config.json)
    eos_token_ids: list = field(default_factory=list)
    api_key: Optional[str] = None
    chat_template: Optional[str] = None
    reasoning_parser: Optional[str] = None  # --reasoning-parser: chat answers' thinking split out (`reasoning.py`)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_grammar_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES  # --max-grammar-bytes: larger constraints are a 400
    created: int = field(default_factory=lambda: int(time.time()))
    adapters: dict = field(default_factory=dict)  # LoRA adapter name -> the folder it was loaded from
    responses: ResponseStore = field(default_factory=ResponseStore)  # /v1/responses' stored responses
    runtime_lora: bool = False  # adapters may be loaded and unloaded at run time (routes/adapters.py)
    lora_root: Optional[str] = None  # the real path run-time loads must resolve inside (None: refuse all)


def error_response(
    status: int, message: str, kind: str = "invalid_request_error", param=None, headers=None
) -> JSONResponse:
    """OpenAI's error JSON with its status, for the places that answer rather than raise `ApiError`."""
    return JSONResponse(ApiError(status, message, param, kind).body(), status_code=status, headers=headers)


async def read_body(state: ServerState, request: Request) -> Any:
    """The request's JSON body, read as it streams in: 413 past `max_body_bytes` (a body that declared no
    length gets here past the guard), 400 when it is not JSON. An empty body is `None`."""
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > state.max_body_bytes:
            raise ApiError(413, f"The request body is more than the limit of {state.max_body_bytes} bytes.")
    return await asyncio.to_thread(_parsed, bytes(raw))  # a body of megabytes: off the event loop


class _NotFinite(ValueError):
    """A number JSON cannot carry back (NaN, Infinity, or one too large for a float)."""


def _constant(text: str):
    raise _NotFinite(text)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotFinite(text)
    return value


def _parsed(raw: bytes) -> Any:
    try:
        body = json.loads(raw or b"null", parse_constant=_constant, parse_float=_finite_float)
    except _NotFinite as err:
        raise ApiError(
            400,
            f"The request body holds the number {err}, which JSON does not allow and no answer "
            f"could repeat: send finite numbers.",
        ) from None
    except RecursionError:
        raise ApiError(400, f"The request body nests JSON more than {MAX_DEPTH} levels deep: flatten it.") from None
    except ValueError:
        raise ApiError(400, "The request body is not valid JSON.") from None
    check_text(body)
    return body


def check_text(body: Any) -> None:
    """Refuse (400) a body nested more than `MAX_DEPTH` deep or holding a string that is not valid Unicode
    (a lone UTF-16 surrogate such as "\\ud800", which JSON allows and no tokenizer can encode), naming
    where. Iterative: a deep body cannot exhaust the stack here."""
    stack = [(body, "body", 0)]
    while stack:
        value, where, depth = stack.pop()
        if depth >= MAX_DEPTH and isinstance(value, (dict, list)):  # the 65th container, counting the body
            raise ApiError(
                400, f"The request body nests JSON more than {MAX_DEPTH} levels deep (at {where}): flatten it."
            )
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as err:
                raise ApiError(
                    400,
                    f"{where} holds a lone UTF-16 surrogate ({value[err.start]!r} at character "
                    f"{err.start}), which is not text: send valid Unicode.",
                ) from None
        elif isinstance(value, dict):
            for k, v in value.items():
                stack.append((k, f"a key of {where}", depth + 1))
                stack.append((v, f"{where}.{k}" if where != "body" else k, depth + 1))
        elif isinstance(value, list):
            stack.extend((v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value))


def check_model(state: ServerState, name: Any) -> tuple[Optional[str], str]:
    """(the adapter a request's `model` picks, None for the base; the name its answer carries)."""
    if name is None or name == state.model_name:
        return None, state.model_name
    if isinstance(name, str) and name in state.adapters:
        return name, name
    served = ", ".join(map(repr, [state.model_name, *state.adapters]))
    raise ApiError(
        404,
        f"The model {name!r} does not exist here: this server serves {served}.",
        param="model",
        kind="invalid_request_error",
        code="model_not_found",
    )


__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_GRAMMAR_BYTES",
    "MAX_DEPTH",
    "ServerState",
    "check_model",
    "check_text",
    "error_response",
    "read_body",
]
