"""The endpoints that describe the server rather than generate: `GET /v1/models` (the base model and its
LoRA adapters), `GET /health` (503 once the engine has failed or while it drains), `GET /metrics`
(Prometheus)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import Response

from ..state import ServerState, error_response


def register(app: FastAPI, state: ServerState) -> None:
    """Add these endpoints to `app`, their handlers reading `state`."""

    @app.get("/health")
    async def health():
        if state.engine.failed is not None:
            return error_response(503, f"The engine failed: {state.engine.failed}", kind="server_error")
        if state.engine.draining:
            return error_response(503, "The server is shutting down.", kind="server_error")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    @app.get("/v1/models")
    async def models():
        base = {
            "id": state.model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "staticformers",
            "max_model_len": state.max_model_len,
            "parent": None,
        }
        loras = [
            {
                "id": name,
                "object": "model",
                "created": state.created,
                "owned_by": "staticformers",
                "max_model_len": state.max_model_len,
                "root": path,
                "parent": state.model_name,
            }
            for name, path in state.adapters.items()
        ]
        return {"object": "list", "data": [base, *loras]}


__all__ = ["register"]
