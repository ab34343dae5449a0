"""The OpenAI-compatible server over the generation loop (the `serve` extra: FastAPI, uvicorn, prometheus_client).

protocol.py (request bodies, checked), text.py (detokenisation, stop strings, tool calls),
engine_thread.py (the loop in its own thread), replication.py (tensor parallel under torchrun),
metrics.py (Prometheus), app.py (the FastAPI app: the guard, error JSON, the endpoints), routes/ (one module
per endpoint group), state.py (what every handler shares), runs.py (a generation job's life: queued,
followed, answered whole or streamed), server.py (starting and stopping).

May import: api, generation, training, distributed, backends, compilation, adapters, tokenization, models,
checkpoints, utils; never commands.
"""
