"""The OpenAI-compatible HTTP API over the engine thread (FastAPI).

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (the chat template, `tools` passed to
it, Qwen/Hermes tool calls returned as OpenAI `tool_calls`), `POST /v1/responses` and
`GET /v1/responses/{id}` (the Responses API, `routes/responses.py`), `POST /v1/load_lora_adapter` and
`POST /v1/unload_lora_adapter` (`routes/adapters.py`, with `--enable-lora-runtime-updates`), `GET /v1/models`, `GET /health` (503 once
the engine has failed or while it drains), `GET /metrics` (Prometheus), `POST /tokenize`,
`POST /detokenize`. Streaming is server-sent events in OpenAI's chunk format, ending with
`data: [DONE]`, with `stream_options.include_usage`.

Every refusal is OpenAI's error JSON: 400 for an invalid field (its name and value in the message; a
prompt plus `max_tokens` beyond `--max-model-len` with both numbers), 401 for a missing or wrong API
key (`/v1/*`, `/tokenize`, `/detokenize`), 404 for a model it does not serve (neither the base model's
name nor one of its LoRA adapters' names, `--lora-modules`: a request's `model` picks its adapter), 413 for a body over the
size limit, 429 with `Retry-After` when the queue is full, 500 when the engine failed the request,
503 while shutting down. A client that disconnects (mid-stream, or while waiting for a whole answer)
has its requests cancelled: their slots are free before the next decode step.

This module builds the app: the guard, the handler that turns `ApiError` into its JSON, and the endpoints of
`serving/routes/` (one module per endpoint group, each adding its own).
"""

from __future__ import annotations

import hmac
import logging
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .protocol import ApiError
from .routes import adapters, chat, completions, models, responses, tokens
from .state import ServerState, error_response

PROTECTED = ("/v1/", "/tokenize", "/detokenize")

logger = logging.getLogger("staticformers")


class Guard:
    """The API key and the declared body size, checked before a handler runs, and any exception a handler
    lets out answered as OpenAI's JSON 500 (a plain ASGI middleware: Starlette's `BaseHTTPMiddleware`
    would put every streamed chunk through one more queue)."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self.refusal(scope)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        started = False

        async def sending(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as err:  # a bug: still OpenAI's JSON (once no answer has begun), never a bare 500
            logger.error("%s %s failed", scope.get("method"), scope.get("path"), exc_info=err)
            if started:
                return
            await error_response(
                500, f"The server failed this request ({type(err).__name__}): report it.", kind="server_error"
            )(scope, receive, send)

    def refusal(self, scope) -> Optional[Response]:
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        if self.state.api_key and scope["path"].startswith(PROTECTED):
            header = headers.get(b"authorization", b"")
            if not hmac.compare_digest(header, f"Bearer {self.state.api_key}".encode()):  # in constant time
                what = "is missing" if not header else "is wrong"
                return error_response(
                    401, f"The API key {what}: send it as 'Authorization: Bearer <key>'.", kind="authentication_error"
                )
        length = headers.get(b"content-length", b"").decode("latin-1")
        if length.isdigit() and int(length) > self.state.max_body_bytes:
            return error_response(
                413, f"The request body has {length} bytes, more than the limit of {self.state.max_body_bytes}."
            )
        return None


def create_app(state: ServerState) -> FastAPI:
    """The FastAPI app over `state`: the guard, OpenAI's error JSON for every `ApiError`, every route."""
    app = FastAPI(title="staticformers", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Guard, state=state)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError):
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException):  # 404 no such route, 405 method
        what = {
            404: f"There is no endpoint {request.url.path}.",
            405: f"{request.url.path} does not take {request.method}.",
        }.get(err.status_code, str(err.detail))
        return error_response(
            err.status_code,
            what,
            kind="invalid_request_error" if err.status_code < 500 else "server_error",
            headers=getattr(err, "headers", None),
        )

    for group in (models, tokens, completions, chat, responses, adapters):
        group.register(app, state)
    return app


__all__ = ["Guard", "create_app"]
