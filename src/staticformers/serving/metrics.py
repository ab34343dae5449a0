"""The server's Prometheus metrics: vLLM's names with our prefix, a `model_name` label on each.

One `CollectorRegistry` per server, so several servers in one process (tests) never collide, served
at `GET /metrics` in Prometheus' text format.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "staticformers:"
# latencies from a millisecond to a few minutes
_SECONDS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
            40.0, 80.0, 160.0, 640.0)


class ServerMetrics:
    """Every metric the server reports (see the module docstring)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry

        def gauge(name, doc):
            return Gauge(PREFIX + name, doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(PREFIX + name, doc, labels, registry=r).labels(model_name)

        def histogram(name, doc):
            return Histogram(PREFIX + name, doc, labels, buckets=_SECONDS, registry=r).labels(model_name)

        self.running = gauge("num_requests_running", "Requests holding a decode slot.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting for a slot.")
        self.padding = gauge("num_slots_padding", "Slots of the current decode batch that carry no request.")
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to the first token, per request.")
        self.itl = histogram("inter_token_latency_seconds", "Time between two tokens of one request.")
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to the last token, per request.")
        self.prompt_tokens = counter("prompt_tokens_total", "Prompt tokens prefilled.")
        self.generation_tokens = counter("generation_tokens_total", "Tokens generated.")
        self.graphs = counter("graphs_compiled_total", "Graphs compiled (or loaded from the on-disk cache) since start.")
        self.disconnects = counter("client_disconnects_total", "Requests whose client went away before the end.")
        self._success = Counter(PREFIX + "request_success_total", "Finished requests, by reason.",
                                labels + ["finished_reason"], registry=r)
        self.errors = counter("request_errors_total", "Requests that failed inside the engine (HTTP 500).")

    def finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


__all__ = ["ServerMetrics", "PREFIX"]
