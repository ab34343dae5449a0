"""The server's endpoints, one module per group: completions.py (`POST /v1/completions`), chat.py
(`POST /v1/chat/completions`), models.py (`GET /v1/models`, `/health`, `/metrics`), tokens.py
(`POST /tokenize`, `/detokenize`).

Each module's `register(app, state)` adds its handlers to the app, reading that `ServerState`;
`serving/app.py:create_app` calls them. (Not `APIRouter`s: FastAPI matches an included router's
routes through one more layer, and the routes added straight to the app are the ones it always had.) What they share is in `serving/state.py` (the body, the
model check, error JSON) and `serving/runs.py` (queueing a job, following its choices, the answer).
"""
