"""The server's Prometheus metrics: vLLM's names with our prefix, a `model_name` label on each.

One `CollectorRegistry` per server, so several servers in one process (tests) never collide, served
at `GET /metrics` in Prometheus' text format. What one request adds (tokens, latencies, how it ended)
is counted under the name it asked for: the base's served name, or an adapter's (`requests(name)`);
what the engine does for all of them (slots, the queue, graphs compiled since start, precompiling
included) under the base's.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..generation.constraints import MASK_TIME

PREFIX = "staticformers:"
# latencies from a millisecond to a few minutes
_SECONDS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)


class RequestMetrics:
    """The per-request metrics of one served name (the base model's, or an adapter's)."""

    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    prompt_tokens: Counter
    generation_tokens: Counter
    disconnects: Counter
    errors: Counter

    def __init__(self, families: dict, name: str):
        self.name = name
        for key in ("ttft", "itl", "e2e", "prompt_tokens", "generation_tokens", "disconnects", "errors"):
            setattr(self, key, families[key].labels(name))
        self._success = families["success"]

    def finished(self, reason: str) -> None:
        self._success.labels(self.name, reason).inc()


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
            return Histogram(PREFIX + name, doc, labels, buckets=_SECONDS, registry=r)

        def requests(name, doc):
            return Counter(PREFIX + name, doc, labels, registry=r)

        self.running = gauge("num_requests_running", "Requests holding a decode slot.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting for a slot.")
        self.padding = gauge("num_slots_padding", "Slots of the current decode batch that carry no request.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Share of the KV pool's blocks that requests hold (block caches).")
        self.preemptions = counter("num_preemptions_total", "Requests preempted for want of KV blocks (resumed later).")
        gauge(
            "structured_mask_seconds", "Host seconds spent filling grammar masks (structured outputs) since start."
        ).set_function(lambda: MASK_TIME["seconds"])
        gauge(
            "structured_mask_steps", "Steps (prefills and decodes) that filled a grammar mask since start."
        ).set_function(lambda: MASK_TIME["steps"])
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.")
        self.graphs = counter(
            "graphs_compiled_total",
            "Graphs compiled (or loaded from the on-disk cache) since start, precompiling included.",
        )
        # speculative decoding (--speculative-config): tokens proposed, and those the target accepted
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Tokens proposed by speculative decoding.")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Proposed tokens the target accepted.")
        self._families = {
            "ttft": histogram("time_to_first_token_seconds", "Arrival to the first token, per request."),
            "itl": histogram("inter_token_latency_seconds", "Time between two tokens of one request."),
            "e2e": histogram("e2e_request_latency_seconds", "Arrival to the last token, per request."),
            "prompt_tokens": requests("prompt_tokens_total", "Prompt tokens prefilled."),
            "generation_tokens": requests("generation_tokens_total", "Tokens generated."),
            "disconnects": requests("client_disconnects_total", "Requests whose client went away before the end."),
            "success": Counter(
                PREFIX + "request_success_total",
                "Finished requests, by reason.",
                labels + ["finished_reason"],
                registry=r,
            ),
            "errors": requests("request_errors_total", "Requests that failed inside the engine (HTTP 500)."),
        }
        self._requests: dict[str, RequestMetrics] = {}
        base = self.requests(model_name)  # the base's, shown from the start
        self.ttft, self.itl, self.e2e = base.ttft, base.itl, base.e2e
        self.prompt_tokens, self.generation_tokens = base.prompt_tokens, base.generation_tokens
        self.disconnects, self.errors, self.finished = base.disconnects, base.errors, base.finished

    def requests(self, name: str) -> RequestMetrics:
        """The per-request metrics counted under `name` (the base's served name, or an adapter's)."""
        if name not in self._requests:
            self._requests[name] = RequestMetrics(self._families, name)
        return self._requests[name]

    def render(self) -> bytes:
        return generate_latest(self.registry)


__all__ = ["ServerMetrics", "RequestMetrics", "PREFIX"]
