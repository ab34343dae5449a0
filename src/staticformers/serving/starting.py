"""The server's port answers from the first second: 503 with the reason until the model is ready.

Loading a checkpoint and compiling its shape plan take minutes; a supervisor (Kubernetes, systemd, a
load balancer) that finds nothing on the port meanwhile cannot tell a slow start from a dead one. So
`serve` binds its port first and runs uvicorn over a `Starting` app at once: until the real app is set
(`ready(app)`), every request gets OpenAI's error JSON with 503, `Retry-After` and what the server is
doing (`/health` too), and once it is set, every request goes to it.
"""

from __future__ import annotations

from .state import error_response


class Starting:
    """An ASGI app that answers 503 with `doing` until `ready(app)`, then is that app."""

    def __init__(self, doing: str):
        self.doing = doing
        self.app = None

    def ready(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if self.app is not None:
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":  # lifespan and the like: nothing to start
            return
        await error_response(
            503,
            f"The server is starting ({self.doing}): retry in a moment.",
            kind="server_error",
            headers={"Retry-After": "5"},
        )(scope, receive, send)


__all__ = ["Starting"]
