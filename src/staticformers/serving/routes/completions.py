"""`POST /v1/completions`: a prompt (or several, or token ids) continued, `n` choices per prompt, with
`echo`, `logprobs` (with `echo`, the prompt's too, first token null, from the prefill; `max_tokens=0`
then scores the prompt alone, what evaluation harnesses send), stop strings, and streaming in OpenAI's `text_completion` chunks. What differs from
chat is only the JSON of a choice; the request's life is `serving/runs.py`."""

from __future__ import annotations

import asyncio
from typing import Callable, Optional

from fastapi import FastAPI, Request

from ..protocol import Job, parse_completion
from ..runs import Delta, completion_logprobs, prompt_tokens, reply, usage
from ..state import ServerState, check_model, read_body

KIND = "text_completion"


def register(app: FastAPI, state: ServerState) -> None:
    """Add these endpoints to `app`, their handlers reading `state`."""

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_body(state, request)
        adapter, served = check_model(state, body.get("model")) if isinstance(body, dict) else (None, state.model_name)
        job = await asyncio.to_thread(
            parse_completion,
            body,
            state.tokenizer,
            state.defaults,
            state.eos_token_ids,
            state.max_model_len,
            state.max_n,
        )  # tokenizing: off the event loop
        return await reply(state, request, job, "cmpl", adapter, served, _chunks, _answer, KIND)


def _chunks(tokenizer, job: Job, rid: str, created: int, served: str, n: int) -> Callable[[Delta], Optional[dict]]:
    """The streamed chunk of each delta (None when it adds nothing): a choice's first chunk carries the
    echoed prompt, and logprobs' text offsets continue across a choice's chunks."""
    offsets = [0] * n
    echoed = set()

    def chunk(d: Delta) -> Optional[dict]:
        text = d.text
        logprobs = None
        if job.echo and d.index not in echoed:
            echoed.add(d.index)
            p = job.choices[d.index].prompt_index
            text = job.prompt_texts[p] + text
            if job.logprobs is not None:
                logprobs = completion_logprobs(tokenizer, prompt_tokens(job.prompts[p], d.prompt_logprobs), 0)
                offsets[d.index] = len(job.prompt_texts[p])
        if job.logprobs is not None and d.tokens:
            logprobs = completion_logprobs(tokenizer, d.tokens, offsets[d.index], logprobs)
        offsets[d.index] += len(d.text)
        if not text and logprobs is None and d.finish_reason is None:
            return None
        return {
            "id": rid,
            "object": KIND,
            "created": created,
            "model": served,
            "choices": [{"index": d.index, "text": text, "logprobs": logprobs, "finish_reason": d.finish_reason}],
        }

    return chunk


def _answer(tokenizer, job: Job, rid: str, created: int, served: str, runs: list, collected: list) -> dict:
    """The whole answer: each choice's text (after its echoed prompt), logprobs (the echoed prompt's first)
    and finish reason, and usage."""
    choices = []
    for run, deltas in zip(runs, collected):
        text = "".join(d.text for d in deltas)
        p = job.choices[run.index].prompt_index
        prefix = job.prompt_texts[p] if job.echo else ""
        tokens = [t for d in deltas for t in d.tokens]
        logprobs = None
        if job.logprobs is not None:
            scores = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None)
            logprobs = completion_logprobs(tokenizer, prompt_tokens(job.prompts[p], scores), 0) if job.echo else None
            logprobs = completion_logprobs(tokenizer, tokens, len(prefix), logprobs)
        choices.append(
            {"index": run.index, "text": prefix + text, "logprobs": logprobs, "finish_reason": run.finish_reason}
        )
    return {
        "id": rid,
        "object": KIND,
        "created": created,
        "model": served,
        "choices": choices,
        "usage": usage(job, runs),
    }


__all__ = ["register"]
