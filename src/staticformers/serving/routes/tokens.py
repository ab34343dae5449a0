"""`POST /tokenize` (a prompt, or chat messages through the chat template, to token ids) and
`POST /detokenize` (token ids, each checked against the vocabulary, to text), as vLLM names them."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request

from ..protocol import ApiError, check_fields, parse_chat
from ..state import ServerState, check_model, read_body


def register(app: FastAPI, state: ServerState) -> None:
    """Add these endpoints to `app`, their handlers reading `state`."""

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await _object(state, request)
        ids = await asyncio.to_thread(_tokenize, state, body)  # rendering, tokenizing: off the event loop
        return {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await _object(state, request)
        check_fields(body, "detokenize")
        tokens = body.get("tokens")
        vocab = len(state.tokenizer)
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise ApiError(400, f"tokens={tokens!r} must be a list of integer token ids.", param="tokens")
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"tokens={bad[:4]!r} are outside the vocabulary [0, {vocab}).", param="tokens")
        return {"prompt": state.tokenizer.decode(tokens)}


__all__ = ["register"]


def _tokenize(state: ServerState, body: dict) -> list:
    """The ids of a /tokenize body: chat messages through the template, or a prompt."""
    if "messages" in body:
        job = parse_chat(
            body,
            state.tokenizer,
            state.defaults,
            state.eos_token_ids,
            10**9,
            1,
            state.chat_template,
            endpoint="tokenize",
        )
        return job.prompts[0]
    if isinstance(body.get("prompt"), str):
        check_fields(body, "tokenize")
        add = body.get("add_special_tokens", True)
        if not isinstance(add, bool):
            raise ApiError(400, f"add_special_tokens={add!r} must be true or false.", param="add_special_tokens")
        ids = state.tokenizer(body["prompt"], add_special_tokens=add)["input_ids"]
        return list(ids.tolist() if hasattr(ids, "tolist") else ids)
    raise ApiError(400, 'Pass "prompt" (a string) or "messages" to tokenize.', param="prompt")


async def _object(state: ServerState, request: Request) -> dict:
    """The body as a JSON object whose `model` (if any) is served here."""
    body = await read_body(state, request)
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    check_model(state, body.get("model"))
    return body
