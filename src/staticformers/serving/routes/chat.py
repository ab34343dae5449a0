"""`POST /v1/chat/completions`: messages through the chat template (with `tools`), `n` choices, the
assistant's content and its Qwen/Hermes tool calls returned as OpenAI `tool_calls`, `logprobs`, and
streaming in `chat.completion.chunk`s. What differs from completions is only the JSON of a choice; the
request's life is `serving/runs.py`."""

from __future__ import annotations

import asyncio
from typing import Callable, Optional

from fastapi import FastAPI, Request

from ..protocol import Job, parse_chat
from ..reasoning import prompt_state
from ..runs import Delta, chat_logprobs, reply, usage
from ..state import ServerState, check_model, read_body

CHUNK = "chat.completion.chunk"


def register(app: FastAPI, state: ServerState) -> None:
    """Add these endpoints to `app`, their handlers reading `state`."""

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await read_body(state, request)
        adapter, served = check_model(state, body.get("model")) if isinstance(body, dict) else (None, state.model_name)
        job = await asyncio.to_thread(
            parse_chat,
            body,
            state.tokenizer,
            state.defaults,
            state.eos_token_ids,
            state.max_model_len,
            state.max_n,
            state.chat_template,
        )  # rendering, tokenizing:
        # off the event loop, so one long prompt or slow template never stalls the other connections
        if state.reasoning_parser is not None:
            job.reasoning = prompt_state(state.reasoning_parser, job.prompt_texts[0])
        return await reply(state, request, job, "chatcmpl", adapter, served, _chunks, _answer, CHUNK)


def _chunks(tokenizer, job: Job, rid: str, created: int, served: str, n: int) -> Callable[[Delta], Optional[dict]]:
    """The streamed chunk of each delta (None when it adds nothing): a choice's first chunk carries the
    role; tool calls stream as deltas numbered across a choice's chunks (`text.ToolCallParser`)."""
    opened = set()

    def chunk(d: Delta) -> Optional[dict]:
        delta: dict = {}
        if d.index not in opened:
            opened.add(d.index)
            delta["role"] = "assistant"
        if d.reasoning:
            delta["reasoning_content"] = d.reasoning
        if d.text:
            delta["content"] = d.text
        if d.call_deltas:  # OpenAI's call deltas: index, id and name first, then the arguments in fragments
            delta["tool_calls"] = d.call_deltas
        logprobs = {"content": chat_logprobs(tokenizer, d.tokens)} if job.logprobs is not None and d.tokens else None
        if not delta and logprobs is None and d.finish_reason is None:
            return None
        return {
            "id": rid,
            "object": CHUNK,
            "created": created,
            "model": served,
            "choices": [{"index": d.index, "delta": delta, "logprobs": logprobs, "finish_reason": d.finish_reason}],
        }

    return chunk


def _answer(tokenizer, job: Job, rid: str, created: int, served: str, runs: list, collected: list) -> dict:
    """The whole answer: each choice's message (content, or None beside tool calls), logprobs and finish
    reason, and usage."""
    choices = []
    for run, deltas in zip(runs, collected):
        calls = [c for d in deltas for c in d.tool_calls]
        content = "".join(d.text for d in deltas)
        message: dict = {"role": "assistant", "content": content if (content or not calls) else None}
        if calls:
            message["tool_calls"] = calls
        if job.reasoning is not None:
            message["reasoning_content"] = run.reasoner.reasoning
        tokens = [t for d in deltas for t in d.tokens]
        choices.append(
            {
                "index": run.index,
                "message": message,
                "logprobs": {"content": chat_logprobs(tokenizer, tokens)} if job.logprobs is not None else None,
                "finish_reason": run.finish_reason,
            }
        )
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": served,
        "choices": choices,
        "usage": usage(job, runs),
    }


__all__ = ["register"]
