"""A generation job's life on the HTTP side, shared by the completions and chat routes.

`start` checks and queues one `GenerationRequest` per choice and returns a `ChoiceRun` for each, which
turns its token events into `Delta`s (text after stop strings, tool calls, logprobs, the finish reason)
and counts them in the metrics. The answer is then either `whole` (every delta collected; the requests
are cancelled if the client goes away) or `streamed` (server-sent events built by the route's `chunk`
function; a stream the client leaves has its requests cancelled). Only the JSON of one choice differs
between the two routes, and that stays in each route.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional

from fastapi import Request
from fastapi.responses import StreamingResponse

from ..generation.constraints import compiler_for
from ..generation.loop import GenerationRequest
from ..generation.plan import PlanError
from ..tokenization.token_bytes import shown_text, token_bytes
from .engine_thread import Draining, EngineFailed, QueueFull, Sink
from .protocol import ApiError, Job
from .state import ServerState
from .reasoning import PARSERS, ReasoningSplitter
from .text import CLOSE, OPEN, ChoiceText, ToolCallParser
from .tool_grammar import tool_call_grammar


# ---------------------------------------------------------------------------------------------
# one choice: its events, its text
# ---------------------------------------------------------------------------------------------
@dataclass
class Delta:
    """What one event adds to one choice of the response."""

    index: int
    text: str = ""
    tool_calls: list = field(default_factory=list)
    call_deltas: list = field(default_factory=list)  # the same calls as OpenAI's streamed deltas (`text.py`)
    reasoning: str = ""  # with a reasoning parser: the thinking's text (`reasoning.py`)
    tokens: list = field(default_factory=list)  # (token id, logprob, top [(id, logprob)])
    prompt_logprobs: Optional[list] = None  # the first delta's, when the prompt was scored (`TokenEvent`'s)
    finish_reason: Optional[str] = None
    error: Optional[BaseException] = None


class ChoiceRun:
    """Follows one generation request: turns its events into deltas (text after stop strings, tool calls)."""

    def __init__(
        self, state: ServerState, job: Job, index: int, request_id: str, sink: Sink, arrival: float, metrics=None
    ):
        self.state, self.job, self.index, self.request_id, self.sink = state, job, index, request_id, sink
        self.metrics = metrics or state.metrics  # counted under the name the request asked for
        self.text = ChoiceText(state.tokenizer, job.stop, job.skip_special_tokens)
        self.tools = ToolCallParser(forced=job.tool_choice is not None) if job.tools else None
        self.reasoner = ReasoningSplitter(state.reasoning_parser, job.reasoning) if job.reasoning else None
        self.arrival, self.last = arrival, None
        self.completion_tokens = 0
        self.finish_reason: Optional[str] = None
        # max_tokens=0 (echo, scoring the prompt): one token is generated, since a request ends with one, and dropped
        self.silent = job.max_tokens[job.choices[index].prompt_index] == 0

    def _content(self, text: str, final: bool = False) -> tuple[str, list, list, str]:
        """(content, tool calls, their deltas, reasoning) of a text delta: the reasoning split out first."""
        reasoning = ""
        if self.reasoner is not None:
            reasoning, text = self.reasoner.feed(text, final)
        if self.tools is None:
            return text, [], [], reasoning
        out, calls = self.tools.feed(text)
        if final:
            more, tail = self.tools.finish()
            out, calls = out + more, calls + tail
        return out, calls, self.tools.take_deltas(), reasoning

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
                text, calls, deltas, reasoning = self._content(self.text.finish(), final=True)
                yield Delta(self.index, text, calls, deltas, reasoning, finish_reason=self.finish_reason)
                return
            if self.silent:  # its one event is its last
                self.state.engine.cancel(self.request_id)
                self.finish_reason = "length"
                m.e2e.observe(now - self.arrival)
                m.finished("length")
                yield Delta(self.index, prompt_logprobs=event.prompt_logprobs, finish_reason="length")
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
            text, calls, deltas, reasoning = self._content(piece, final)
            if final:
                if self.tools is not None and self.tools.calls and reason == "stop":  # a cut answer stays "length"
                    reason = "tool_calls"
                self.finish_reason = reason
                m.e2e.observe(now - self.arrival)
                m.finished(reason if reason != "tool_calls" else "stop")
            yield Delta(self.index, text, calls, deltas, reasoning, tokens, event.prompt_logprobs, reason)
            if final:
                return


# ---------------------------------------------------------------------------------------------
# what both answers carry: logprobs, usage
# ---------------------------------------------------------------------------------------------
def _token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token])


def prompt_tokens(prompt: list, scores: Optional[list]) -> list:
    """A scored prompt as `completion_logprobs`' tokens: (id, logprob, top), the first one's None (nothing
    predicts it), as OpenAI's echo and vLLM report it."""
    if scores is None:
        return []
    return [(t, None, None) if s is None else (t, s[0], s[1]) for t, s in zip(prompt, scores)]


def completion_logprobs(tokenizer, tokens: list, offset: int, out: Optional[dict] = None) -> dict:
    """A completion choice's `logprobs` (tokens, their logprobs, the top ones, text offsets from `offset`),
    appended to `out` when given (an echoed prompt's). A token that is part of a character is shown as
    `bytes:\\xNN` (`tokenization/token_bytes.py`), so the top tokens, keyed by text, stay apart; two tokens of
    the same text (rare) keep the likelier one's key and the other is keyed `token_id:N`, as vLLM names
    tokens by id."""
    out = out if out is not None else {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, logprob, top in tokens:
        out["tokens"].append(shown_text(tokenizer, token))
        out["token_logprobs"].append(logprob)
        keyed = None
        if top:
            keyed = {}
            for t, lp in top:  # most likely first
                key = shown_text(tokenizer, t)
                keyed[key if key not in keyed else f"token_id:{t}"] = lp
        out["top_logprobs"].append(keyed)
        out["text_offset"].append(offset)
        offset += len(_token_text(tokenizer, token))
    return out


def chat_logprobs(tokenizer, tokens: list) -> list:
    """A chat choice's `logprobs.content`: one entry per token, with its own bytes and the top logprobs."""

    def entry(token, logprob):
        return {"token": shown_text(tokenizer, token), "logprob": logprob, "bytes": list(token_bytes(tokenizer, token))}

    return [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in (top or [])]} for t, lp, top in tokens]


def usage(job: Job, runs: list) -> dict:
    """The answer's `usage`: each prompt counted once per choice drawn from it."""
    prompt = sum(len(p) for p in job.prompts) * (len(job.choices) // len(job.prompts))
    completion = sum(r.completion_tokens for r in runs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# ---------------------------------------------------------------------------------------------
# a job's requests: queued, followed, cancelled
# ---------------------------------------------------------------------------------------------
async def start(state: ServerState, job: Job, prefix: str, adapter: Optional[str] = None) -> tuple[str, list]:
    """Validate and queue a job's requests (computed with `adapter`, None: the base model); returns the
    response id and one ChoiceRun per choice. Its grammar compiles in a worker thread: a large one takes
    seconds, which the event loop (every other connection, `/health`) must not wait for."""
    rid = f"{prefix}-{uuid.uuid4().hex}"
    aloop = asyncio.get_running_loop()
    grammar = await asyncio.to_thread(constraint, state, job)
    requests = [
        GenerationRequest(
            job.prompts[c.prompt_index],
            max(1, job.max_tokens[c.prompt_index]),
            c.sampling,
            request_id=f"{rid}-{c.index}",
            adapter=adapter,
            structured_outputs=grammar,
        )
        for c in job.choices
    ]
    try:
        for r in requests:
            state.engine.loop.validate(r)
    except PlanError as err:
        raise ApiError(400, str(err), param="max_tokens") from None
    except ValueError as err:
        raise ApiError(400, str(err)) from None
    if len(requests) > state.engine.max_queued:  # it would never fit, however long the client waits
        raise ApiError(
            400,
            f"This request asks for {len(requests)} sequences (prompts x n), more than the "
            f"{state.engine.max_queued} the server's queue holds (--max-queued-requests): ask for at "
            f"most {state.engine.max_queued}.",
            param="n",
        )
    sinks = [Sink(aloop) for _ in requests]
    arrival = time.monotonic()
    try:
        state.engine.submit(list(zip(requests, sinks)))
    except QueueFull:
        raise ApiError(
            429,
            f"The queue is full ({state.engine.max_queued} requests waiting): retry later.",
            kind="rate_limit_error",
            headers={"Retry-After": "1"},
        ) from None
    except Draining:
        raise ApiError(503, "The server is shutting down: send the request elsewhere.", kind="server_error") from None
    except EngineFailed as err:
        raise ApiError(
            503, f"The engine failed ({err}): the server cannot generate any more.", kind="server_error"
        ) from None
    m = state.metrics.requests(adapter or state.model_name)
    m.prompt_tokens.inc(sum(len(r.prompt) for r in requests))
    runs = [
        ChoiceRun(state, job, c.index, r.request_id, s, arrival, m) for c, r, s in zip(job.choices, requests, sinks)
    ]
    return rid, runs


def constraint(state: ServerState, job: Job):
    """The job's compiled grammar (None: free): its `structured_outputs` / `response_format`, or a forced tool
    call; a bad schema, regex or grammar, or a server without llguidance, is a 400 naming the field."""
    spec, param = job.structured, job.structured_param
    if job.tool_choice is not None:
        name = job.tool_choice["function"]["name"] if isinstance(job.tool_choice, dict) else None
        vocab = state.tokenizer.get_vocab()
        # a named function is exactly one call of it; "required" is one call, or several with parallel calls
        spec = tool_call_grammar(
            job.tools, name, job.parallel_tool_calls and name is None, vocab.get(OPEN), vocab.get(CLOSE)
        )
        param = "tool_choice"
    if spec is None:
        return None
    size = len(spec.text().encode("utf-8", "surrogatepass"))
    if size > state.max_grammar_bytes:
        raise ApiError(
            400,
            f"{param} is {size} bytes, more than this server compiles (--max-grammar-bytes="
            f"{state.max_grammar_bytes}): a grammar's compile time grows faster than its size; send a "
            f"smaller one, or restart the server with a larger --max-grammar-bytes.",
            param=param,
        )
    try:
        compiler = compiler_for(state.tokenizer, state.engine.loop.vocab, state.eos_token_ids)
        grammar = compiler.compile(spec, param)
    except ValueError as err:
        raise ApiError(400, str(err), param=param) from None
    if job.reasoning in ("open", "reasoning"):  # the answer after the thinking is constrained, not the thinking
        grammar = grammar.waiting_for(compiler.token_id(PARSERS[state.reasoning_parser][1]))
    return grammar


def cancel(state: ServerState, runs: list, disconnected: bool) -> None:
    """Cancel the runs that have not finished; a client that went away counts as a disconnect and an abort."""
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


# ---------------------------------------------------------------------------------------------
# the two kinds of answer
# ---------------------------------------------------------------------------------------------
async def whole(state: ServerState, request: Request, runs: list) -> list:
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
                cancel(state, runs, disconnected=True)
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
    """One server-sent event holding `data` as JSON."""
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def streamed(
    state: ServerState, job: Job, rid: str, runs: list, chunk: Callable[[Delta], Optional[dict]], kind: str, served: str
) -> StreamingResponse:
    """The answer as server-sent events: `chunk(delta)` per delta (None: nothing to send), the usage chunk
    when asked, then `[DONE]`. A stream that does not reach its end cancels what is left of its runs."""

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
                yield sse(
                    {
                        "id": rid,
                        "object": kind,
                        "created": int(time.time()),
                        "model": served,
                        "choices": [],
                        "usage": usage(job, runs),
                    }
                )
            yield "data: [DONE]\n\n"
            finished = True
        finally:
            if not finished:
                cancel(state, runs, disconnected=True)

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def reply(
    state: ServerState,
    request: Request,
    job: Job,
    prefix: str,
    adapter: Optional[str],
    served: str,
    chunks: Callable,
    answer: Callable,
    kind: str,
):
    """A parsed job's whole life: queued, then streamed (`chunks(tokenizer, job, rid, created, served, n)`
    makes each delta's chunk) or answered whole (`answer(tokenizer, job, rid, created, served, runs,
    collected)`); `kind` is the streamed chunks' `object`."""
    rid, runs = await start(state, job, prefix, adapter)
    created = int(time.time())
    if job.stream:
        return streamed(
            state, job, rid, runs, chunks(state.tokenizer, job, rid, created, served, len(runs)), kind, served
        )
    collected = await whole(state, request, runs)
    return answer(state.tokenizer, job, rid, created, served, runs, collected)


__all__ = [
    "ChoiceRun",
    "Delta",
    "cancel",
    "chat_logprobs",
    "completion_logprobs",
    "merged",
    "prompt_tokens",
    "reply",
    "sse",
    "start",
    "streamed",
    "usage",
    "whole",
]
