"""The OpenAI-compatible HTTP API over the engine thread (FastAPI).

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (the chat template, `tools` passed to
it, Qwen/Hermes tool calls returned as OpenAI `tool_calls`), `GET /v1/models`, `GET /health` (503 once
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
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..generation.loop import GenerationRequest
from ..generation.plan import PlanError
from .engine_thread import Draining, EngineFailed, EngineThread, QueueFull, Sink
from .metrics import ServerMetrics
from .protocol import ApiError, Job, parse_chat, parse_completion
from .text import ChoiceText, ToolCallParser

DEFAULT_MAX_BODY_BYTES = 4 * 2**20


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
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    created: int = field(default_factory=lambda: int(time.time()))
    adapters: dict = field(default_factory=dict)  # LoRA adapter name -> the folder it was loaded from


# ---------------------------------------------------------------------------------------------
# one choice: its events, its text
# ---------------------------------------------------------------------------------------------
@dataclass
class Delta:
    """What one event adds to one choice of the response."""

    index: int
    text: str = ""
    tool_calls: list = field(default_factory=list)
    tokens: list = field(default_factory=list)  # (token id, logprob, top [(id, logprob)])
    finish_reason: Optional[str] = None
    error: Optional[BaseException] = None


class ChoiceRun:
    """Follows one generation request: turns its events into deltas (text after stop strings, tool calls)."""

    def __init__(self, state: ServerState, job: Job, index: int, request_id: str, sink: Sink, arrival: float,
                 metrics=None):
        self.state, self.job, self.index, self.request_id, self.sink = state, job, index, request_id, sink
        self.metrics = metrics or state.metrics  # counted under the name the request asked for
        self.text = ChoiceText(state.tokenizer, job.stop, job.skip_special_tokens)
        self.tools = ToolCallParser() if job.tools else None
        self.arrival, self.last = arrival, None
        self.completion_tokens = 0
        self.finish_reason: Optional[str] = None

    def _content(self, text: str, final: bool = False) -> tuple[str, list]:
        if self.tools is None:
            return text, []
        out, calls = self.tools.feed(text)
        if final:
            more, tail = self.tools.finish()
            out, calls = out + more, calls + tail
        return out, calls

    async def deltas(self) -> AsyncIterator[Delta]:
        m = self.metrics
        while True:
            event = await self.sink.queue.get()
            now = time.monotonic()
            if event.error is not None:
                m.errors.inc()
                self.finish_reason = "error"
                yield Delta(self.index, finish_reason="error", error=event.error)
                return
            if event.token is None:  # cancelled by the server (shutdown)
                self.finish_reason = event.finish_reason or "abort"
                m.finished(self.finish_reason)
                text, calls = self._content(self.text.finish(), final=True)
                yield Delta(self.index, text, calls, finish_reason=self.finish_reason)
                return
            self.completion_tokens += 1
            m.generation_tokens.inc()
            if self.last is None:
                m.ttft.observe(now - self.arrival)
            else:
                m.itl.observe(now - self.last)
            self.last = now
            piece = self.text.push(event.token)
            tokens = [(event.token, event.logprob, event.top_logprobs)] if event.logprob is not None else []
            reason = event.finish_reason
            if self.text.stopped and reason is None:
                reason = "stop"
                self.state.engine.cancel(self.request_id)  # the stop string ended it: free the slot now
            final = reason is not None
            if final:
                piece += self.text.finish()
            text, calls = self._content(piece, final)
            if final:
                if self.tools is not None and self.tools.calls:
                    reason = "tool_calls"
                self.finish_reason = reason
                m.e2e.observe(now - self.arrival)
                m.finished(reason if reason != "tool_calls" else "stop")
            yield Delta(self.index, text, calls, tokens, reason)
            if final:
                return


# ---------------------------------------------------------------------------------------------
# responses
# ---------------------------------------------------------------------------------------------
def _token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token])


def completion_logprobs(tokenizer, tokens: list, offset: int) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, logprob, top in tokens:
        text = _token_text(tokenizer, token)
        out["tokens"].append(text)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append({_token_text(tokenizer, t): lp for t, lp in top} if top else None)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def chat_logprobs(tokenizer, tokens: list) -> list:
    def entry(token, logprob):
        text = _token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in (top or [])]} for t, lp, top in tokens]


def _usage(job: Job, runs: list) -> dict:
    prompt = sum(len(p) for p in job.prompts) * (len(job.choices) // len(job.prompts))
    completion = sum(r.completion_tokens for r in runs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _error(status: int, message: str, kind: str = "invalid_request_error", param=None, headers=None) -> JSONResponse:
    return JSONResponse(ApiError(status, message, param, kind).body(), status_code=status, headers=headers)


# ---------------------------------------------------------------------------------------------
# the app
# ---------------------------------------------------------------------------------------------
PROTECTED = ("/v1/", "/tokenize", "/detokenize")


class Guard:
    """The API key and the declared body size, checked before a handler runs (a plain ASGI middleware:
    Starlette's `BaseHTTPMiddleware` would put every streamed chunk through one more queue)."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            refusal = self.refusal(scope)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def refusal(self, scope) -> Optional[Response]:
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        if self.state.api_key and scope["path"].startswith(PROTECTED):
            header = headers.get(b"authorization", b"").decode("latin-1")
            if header != f"Bearer {self.state.api_key}":
                what = "is missing" if not header else "is wrong"
                return _error(401, f"The API key {what}: send it as 'Authorization: Bearer <key>'.",
                              kind="authentication_error")
        length = headers.get(b"content-length", b"").decode("latin-1")
        if length.isdigit() and int(length) > self.state.max_body_bytes:
            return _error(413, f"The request body has {length} bytes, more than the limit of {self.state.max_body_bytes}.")
        return None


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="staticformers", docs_url=None, redoc_url=None, openapi_url=None)

    app.add_middleware(Guard, state=state)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError):
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    async def body_of(request: Request) -> Any:
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > state.max_body_bytes:
                raise ApiError(413, f"The request body is more than the limit of {state.max_body_bytes} bytes.")
        try:
            return json.loads(bytes(raw) or b"null")
        except ValueError:
            raise ApiError(400, "The request body is not valid JSON.") from None

    def check_model(name: Any) -> tuple[Optional[str], str]:
        """(the adapter a request's `model` picks, None for the base; the name its answer carries)."""
        if name is None or name == state.model_name:
            return None, state.model_name
        if isinstance(name, str) and name in state.adapters:
            return name, name
        served = ", ".join(map(repr, [state.model_name, *state.adapters]))
        raise ApiError(404, f"The model {name!r} does not exist here: this server serves {served}.",
                       param="model", kind="invalid_request_error", code="model_not_found")

    # ---- plain endpoints ----------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if state.engine.failed is not None:
            return _error(503, f"The engine failed: {state.engine.failed}", kind="server_error")
        if state.engine.draining:
            return _error(503, "The server is shutting down.", kind="server_error")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    @app.get("/v1/models")
    async def models():
        base = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "staticformers",
                "max_model_len": state.max_model_len, "parent": None}
        loras = [{"id": name, "object": "model", "created": state.created, "owned_by": "staticformers",
                  "max_model_len": state.max_model_len, "root": path, "parent": state.model_name}
                 for name, path in state.adapters.items()]
        return {"object": "list", "data": [base, *loras]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await body_of(request)
        if not isinstance(body, dict):
            raise ApiError(400, "The request body must be a JSON object.")
        check_model(body.get("model"))
        if "messages" in body:
            job = parse_chat({**body, "max_tokens": None}, state.tokenizer, state.defaults, state.eos_token_ids,
                             10**9, 1, state.chat_template)
            ids = job.prompts[0]
        elif isinstance(body.get("prompt"), str):
            add = body.get("add_special_tokens", True)
            if not isinstance(add, bool):
                raise ApiError(400, f"add_special_tokens={add!r} must be true or false.", param="add_special_tokens")
            ids = state.tokenizer(body["prompt"], add_special_tokens=add)["input_ids"]
            ids = list(ids.tolist() if hasattr(ids, "tolist") else ids)
        else:
            raise ApiError(400, "Pass \"prompt\" (a string) or \"messages\" to tokenize.", param="prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await body_of(request)
        if not isinstance(body, dict):
            raise ApiError(400, "The request body must be a JSON object.")
        check_model(body.get("model"))
        tokens = body.get("tokens")
        vocab = len(state.tokenizer)
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise ApiError(400, f"tokens={tokens!r} must be a list of integer token ids.", param="tokens")
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"tokens={bad[:4]!r} are outside the vocabulary [0, {vocab}).", param="tokens")
        return {"prompt": state.tokenizer.decode(tokens)}

    # ---- generation ----------------------------------------------------------------------------------
    def start(job: Job, prefix: str, adapter: Optional[str] = None) -> tuple[str, list]:
        """Validate and queue a job's requests (computed with `adapter`, None: the base model); returns the
        response id and one ChoiceRun per choice."""
        rid = f"{prefix}-{uuid.uuid4().hex}"
        aloop = asyncio.get_running_loop()
        requests = [GenerationRequest(job.prompts[c.prompt_index], job.max_tokens[c.prompt_index], c.sampling,
                                      request_id=f"{rid}-{c.index}", adapter=adapter) for c in job.choices]
        try:
            for r in requests:
                state.engine.loop.validate(r)
        except PlanError as err:
            raise ApiError(400, str(err), param="max_tokens") from None
        except ValueError as err:
            raise ApiError(400, str(err)) from None
        sinks = [Sink(aloop) for _ in requests]
        arrival = time.monotonic()
        try:
            state.engine.submit(list(zip(requests, sinks)))
        except QueueFull:
            raise ApiError(429, f"The queue is full ({state.engine.max_queued} requests waiting): retry later.",
                           kind="rate_limit_error", headers={"Retry-After": "1"}) from None
        except Draining:
            raise ApiError(503, "The server is shutting down: send the request elsewhere.", kind="server_error") from None
        except EngineFailed as err:
            raise ApiError(503, f"The engine failed ({err}): the server cannot generate any more.",
                           kind="server_error") from None
        m = state.metrics.requests(adapter or state.model_name)
        m.prompt_tokens.inc(sum(len(r.prompt) for r in requests))
        runs = [ChoiceRun(state, job, c.index, r.request_id, s, arrival, m)
                for c, r, s in zip(job.choices, requests, sinks)]
        return rid, runs

    def cancel(runs: list, disconnected: bool) -> None:
        left = [r for r in runs if r.finish_reason is None]
        for r in left:
            state.engine.cancel(r.request_id)
        if disconnected and left:
            left[0].metrics.disconnects.inc(len(left))
            for r in left:
                r.metrics.finished("abort")

    async def merged(runs: list) -> AsyncIterator[Delta]:
        """Every choice's deltas as they come."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(run):
            async for d in run.deltas():
                await queue.put(d)
            await queue.put(None)

        tasks = [asyncio.create_task(pump(r)) for r in runs]
        try:
            done = 0
            while done < len(runs):
                d = await queue.get()
                if d is None:
                    done += 1
                else:
                    yield d
        finally:
            for t in tasks:
                t.cancel()

    async def whole(request: Request, runs: list) -> list:
        """Every choice's deltas, collected; the requests are cancelled if the client goes away."""
        collected: list = [[] for _ in runs]
        order = {r.index: i for i, r in enumerate(runs)}

        async def collect():
            async for d in merged(runs):
                collected[order[d.index]].append(d)

        task = asyncio.create_task(collect())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=0.1)
                if not task.done() and await request.is_disconnected():
                    task.cancel()
                    cancel(runs, disconnected=True)
                    raise ApiError(499, "The client went away.")
            task.result()
        finally:
            if not task.done():
                task.cancel()
        errors = [d.error for ds in collected for d in ds if d.error is not None]
        if errors:
            raise ApiError(500, f"The engine failed this request: {errors[0]}", kind="server_error")
        return collected

    def sse(data: Any) -> str:
        return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

    def streamed(job: Job, rid: str, runs: list, chunk, kind: str, served: str) -> StreamingResponse:
        async def events():
            finished = False
            try:
                async for d in merged(runs):
                    if d.error is not None:
                        yield sse(ApiError(500, f"The engine failed this request: {d.error}", kind="server_error").body())
                        continue
                    payload = chunk(d)
                    if payload is not None:
                        yield sse(payload)
                if job.include_usage:
                    yield sse({"id": rid, "object": kind, "created": int(time.time()), "model": served,
                               "choices": [], "usage": _usage(job, runs)})
                yield "data: [DONE]\n\n"
                finished = True
            finally:
                if not finished:
                    cancel(runs, disconnected=True)

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await body_of(request)
        adapter, served = check_model(body.get("model")) if isinstance(body, dict) else (None, state.model_name)
        job = parse_completion(body, state.tokenizer, state.defaults, state.eos_token_ids, state.max_model_len,
                               state.max_n)
        rid, runs = start(job, "cmpl", adapter)
        created = int(time.time())
        if job.stream:
            offsets = [0] * len(runs)
            echoed = set()

            def chunk(d: Delta):
                text = d.text
                if job.echo and d.index not in echoed:
                    echoed.add(d.index)
                    text = job.prompt_texts[job.choices[d.index].prompt_index] + text
                logprobs = None
                if job.logprobs is not None and d.tokens:
                    logprobs = completion_logprobs(state.tokenizer, d.tokens, offsets[d.index])
                offsets[d.index] += len(text)
                if not text and logprobs is None and d.finish_reason is None:
                    return None
                return {"id": rid, "object": "text_completion", "created": created, "model": served,
                        "choices": [{"index": d.index, "text": text, "logprobs": logprobs,
                                     "finish_reason": d.finish_reason}]}

            return streamed(job, rid, runs, chunk, "text_completion", served)
        collected = await whole(request, runs)
        choices = []
        for run, deltas in zip(runs, collected):
            text = "".join(d.text for d in deltas)
            prefix = job.prompt_texts[job.choices[run.index].prompt_index] if job.echo else ""
            tokens = [t for d in deltas for t in d.tokens]
            choices.append({"index": run.index, "text": prefix + text,
                            "logprobs": completion_logprobs(state.tokenizer, tokens, len(prefix))
                            if job.logprobs is not None else None,
                            "finish_reason": run.finish_reason})
        return {"id": rid, "object": "text_completion", "created": created, "model": served,
                "choices": choices, "usage": _usage(job, runs)}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await body_of(request)
        adapter, served = check_model(body.get("model")) if isinstance(body, dict) else (None, state.model_name)
        job = parse_chat(body, state.tokenizer, state.defaults, state.eos_token_ids, state.max_model_len, state.max_n,
                         state.chat_template)
        rid, runs = start(job, "chatcmpl", adapter)
        created = int(time.time())
        if job.stream:
            opened = set()
            calls_seen = [0] * len(runs)

            def chunk(d: Delta):
                delta: dict = {}
                if d.index not in opened:
                    opened.add(d.index)
                    delta["role"] = "assistant"
                if d.text:
                    delta["content"] = d.text
                if d.tool_calls:
                    delta["tool_calls"] = [{"index": calls_seen[d.index] + i, **call} for i, call in enumerate(d.tool_calls)]
                    calls_seen[d.index] += len(d.tool_calls)
                logprobs = {"content": chat_logprobs(state.tokenizer, d.tokens)} if job.logprobs is not None and d.tokens else None
                if not delta and logprobs is None and d.finish_reason is None:
                    return None
                return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": served,
                        "choices": [{"index": d.index, "delta": delta, "logprobs": logprobs,
                                     "finish_reason": d.finish_reason}]}

            return streamed(job, rid, runs, chunk, "chat.completion.chunk", served)
        collected = await whole(request, runs)
        choices = []
        for run, deltas in zip(runs, collected):
            calls = [c for d in deltas for c in d.tool_calls]
            content = "".join(d.text for d in deltas)
            message: dict = {"role": "assistant", "content": content if (content or not calls) else None}
            if calls:
                message["tool_calls"] = calls
            tokens = [t for d in deltas for t in d.tokens]
            choices.append({"index": run.index, "message": message,
                            "logprobs": {"content": chat_logprobs(state.tokenizer, tokens)}
                            if job.logprobs is not None else None,
                            "finish_reason": run.finish_reason})
        return {"id": rid, "object": "chat.completion", "created": created, "model": served,
                "choices": choices, "usage": _usage(job, runs)}

    return app


__all__ = ["ServerState", "create_app"]
