"""`POST /v1/responses` (OpenAI's Responses API) and `GET /v1/responses/{id}`.

A request is translated into a chat request (`serving/responses_input.py`) and generated as one chat
choice (`serving/runs.py`); what differs is the answer's shape. The answer is a `response` object whose
`output` holds a `message` item (the text, as `output_text`) and one `function_call` item per tool call
the model made (Qwen/Hermes calls parsed as chat does). Streamed, it is Responses' typed server-sent
events: `response.created`, `response.in_progress`, `response.output_item.added`,
`response.content_part.added`, `response.output_text.delta` ... `.done`, `response.function_call_arguments.delta`
and `.done`, `response.output_item.done`, then `response.completed` (or `response.incomplete` when
`max_output_tokens` cut it, `response.failed` when the engine failed), each with its `sequence_number`.
With `store` (the default) the conversation is kept for `previous_response_id` in the bounded store
(`serving/response_store.py`).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from ..protocol import ApiError, parse_chat
from ..response_store import StoredResponse
from ..responses_input import ResponseRequest, parse_response_request
from ..runs import cancel, merged, start, whole
from ..state import ServerState, check_model, read_body


def register(app: FastAPI, state: ServerState) -> None:
    """Add these endpoints to `app`, their handlers reading `state`."""

    @app.post("/v1/responses")
    async def responses(request: Request):
        body = await read_body(state, request)
        adapter, served = check_model(state, body.get("model")) if isinstance(body, dict) else (None, state.model_name)
        req = parse_response_request(body, state.responses)
        job = parse_chat(
            req.chat, state.tokenizer, state.defaults, state.eos_token_ids, state.max_model_len, 1, state.chat_template
        )
        rid = f"resp_{uuid.uuid4().hex}"
        _, runs = await start(state, job, "resp", adapter)
        answer = Answer(state, req, rid, served, len(job.prompts[0]))
        if req.stream:
            return StreamingResponse(
                answer.events(runs), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        (deltas,) = await whole(state, request, runs)
        for d in deltas:
            answer.add(d)
        return answer.finish(runs[0])

    @app.get("/v1/responses/{response_id}")
    async def stored(response_id: str):
        entry = state.responses.get(response_id)
        if entry is None:
            raise ApiError(
                404,
                f"No stored response has the id {response_id!r} (unknown, not stored, or evicted).",
                param="response_id",
            )
        return entry.response


class Answer:
    """One response being built from its choice's deltas: the output items, then the response object."""

    def __init__(self, state: ServerState, req: ResponseRequest, rid: str, served: str, input_tokens: int):
        self.state, self.req, self.rid, self.served, self.input_tokens = state, req, rid, served, input_tokens
        self.created = int(time.time())
        self.text, self.calls = "", []
        self.message_id = f"msg_{uuid.uuid4().hex}"

    def add(self, d) -> None:
        self.text += d.text
        self.calls += d.tool_calls

    def items(self) -> list:
        out = []
        if self.text or not self.calls:
            out.append(self.message_item("completed"))
        out += [self.call_item(c, "completed") for c in self.calls]
        return out

    def message_item(self, status: str, text: Optional[str] = None) -> dict:
        content = (
            []
            if text is None and status != "completed"
            else [
                {"type": "output_text", "text": self.text if text is None else text, "annotations": [], "logprobs": []}
            ]
        )
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def call_item(call: dict, status: str, arguments: Optional[str] = None) -> dict:
        f = call["function"]
        return {
            "type": "function_call",
            "id": "fc_" + call["id"].removeprefix("call_"),
            "call_id": call["id"],
            "name": f["name"],
            "arguments": f["arguments"] if arguments is None else arguments,
            "status": status,
        }

    def response(
        self,
        status: str,
        output: list,
        completion_tokens: int = 0,
        reason: Optional[str] = None,
        error: Optional[dict] = None,
    ) -> dict:
        usage = {
            "input_tokens": self.input_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.input_tokens + completion_tokens,
        }
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.served,
            "output": output,
            "error": error,
            "incomplete_details": {"reason": reason} if reason else None,
            "usage": usage if status != "in_progress" else None,
            **self.req.echo,
        }

    def finish(self, run) -> dict:
        """The final response object (stored when `store`)."""
        incomplete = run.finish_reason == "length"
        out = self.response(
            "incomplete" if incomplete else "completed",
            self.items(),
            run.completion_tokens,
            "max_output_tokens" if incomplete else None,
        )
        if self.req.store:
            turn: dict = {"role": "assistant", "content": self.text}
            if self.calls:
                turn["tool_calls"] = [dict(c) for c in self.calls]
            self.state.responses.put(self.rid, StoredResponse(self.req.messages + [turn], out))
        return out

    async def events(self, runs: list) -> AsyncIterator[str]:
        """The streamed answer (see the module docstring); a stream the client leaves cancels its run."""
        seq = 0

        def event(kind: str, **data) -> str:
            nonlocal seq
            seq += 1
            return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq - 1, **data})}\n\n"

        finished = False
        opened = False  # the message item is open
        try:
            yield event("response.created", response=self.response("in_progress", []))
            yield event("response.in_progress", response=self.response("in_progress", []))
            async for d in merged(runs):
                if d.error is not None:
                    err = {"code": "server_error", "message": f"The engine failed this request: {d.error}"}
                    yield event("response.failed", response=self.response("failed", self.items(), error=err))
                    finished = True
                    return
                if d.text and not opened:
                    opened = True
                    yield event("response.output_item.added", output_index=0, item=self.message_item("in_progress"))
                    yield event(
                        "response.content_part.added",
                        item_id=self.message_id,
                        output_index=0,
                        content_index=0,
                        part={"type": "output_text", "text": "", "annotations": []},
                    )
                if d.text:
                    yield event(
                        "response.output_text.delta",
                        item_id=self.message_id,
                        output_index=0,
                        content_index=0,
                        delta=d.text,
                        logprobs=[],
                    )
                self.text += d.text
                if d.finish_reason is not None and opened:
                    yield event(
                        "response.output_text.done",
                        item_id=self.message_id,
                        output_index=0,
                        content_index=0,
                        text=self.text,
                        logprobs=[],
                    )
                    yield event(
                        "response.content_part.done",
                        item_id=self.message_id,
                        output_index=0,
                        content_index=0,
                        part={"type": "output_text", "text": self.text, "annotations": []},
                    )
                    yield event("response.output_item.done", output_index=0, item=self.message_item("completed"))
                for call in d.tool_calls:
                    index = int(opened) + len(self.calls)
                    self.calls.append(call)
                    item = self.call_item(call, "in_progress", "")
                    args = call["function"]["arguments"]
                    yield event("response.output_item.added", output_index=index, item=item)
                    yield event(
                        "response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=args
                    )
                    yield event(
                        "response.function_call_arguments.done",
                        item_id=item["id"],
                        output_index=index,
                        arguments=args,
                        name=call["function"]["name"],
                    )
                    yield event("response.output_item.done", output_index=index, item=self.call_item(call, "completed"))
            out = self.finish(runs[0])
            yield event("response.completed" if out["status"] == "completed" else "response.incomplete", response=out)
            finished = True
        finally:
            if not finished:
                cancel(self.state, runs, disconnected=True)


__all__ = ["register"]
