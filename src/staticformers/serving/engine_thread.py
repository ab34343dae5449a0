"""The generation loop in its own thread: requests in from the HTTP event loop, token events back to it.

The HTTP server never runs model code: its handlers `submit` requests and read their events from an
asyncio queue, so a long prefill or decode step never blocks the event loop. The thread owns the
`GenerationLoop` (`generation/loop.py`, its scheduling policy: at most one prefill between two decode
steps), applies submissions and cancellations between steps, and sleeps when there is nothing to do.

- **Load shedding**: at most `max_queued` requests wait for a slot; one more is refused (`QueueFull`,
  HTTP 429) before anything is queued.
- **Cancellation**: a client that goes away cancels its requests; their slots are freed before the
  next step.
- **Failures**: an exception inside a step fails that step's requests (their events carry the error,
  HTTP 500) and the loop goes on. So does one that escapes the loop's own step: the batch's requests
  fail, the loop drops its batch (`GenerationLoop.abandon`) and the next request is served; a request
  the loop cannot take fails alone. Only should the thread itself die (something that is not an
  `Exception`), every waiting request gets the error and `failed` is set (`/health` answers 503).
- **Draining**: `shutdown(grace)` refuses new requests, lets the running ones finish for up to `grace`
  seconds, cancels the rest (`finish_reason` "abort") and stops the thread.
- **Tensor parallel**: with a `replicator` (`replication.py`), every change to the loop is broadcast
  first, so the other ranks run the same steps on their shards.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from ..generation.loop import GenerationLoop, GenerationRequest, TokenEvent

logger = logging.getLogger("staticformers")

HEARTBEAT_SECONDS = 5.0  # an idle tensor-parallel server still talks to its other ranks this often


class QueueFull(Exception):
    """More requests than `--max-queued-requests` would wait."""


class Draining(Exception):
    """The server is shutting down and takes no new requests."""


class EngineFailed(Exception):
    """The engine thread died; the server cannot generate any more."""


class Sink:
    """Where one generation request's events go: an asyncio queue of the HTTP event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, event: TokenEvent) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the HTTP event loop is closed (the server stopped): nobody reads this answer
            pass


@dataclass
class Command:
    """What changes about the loop before one step (what a replicator broadcasts)."""

    adds: list = field(default_factory=list)  # GenerationRequest
    cancels: list = field(default_factory=list)  # request ids
    step: bool = False
    stop: bool = False


class EngineThread:
    """See the module docstring."""

    def __init__(self, loop: GenerationLoop, metrics=None, max_queued: int = 256, replicator=None):
        self.loop, self.metrics, self.max_queued, self.replicator = loop, metrics, int(max_queued), replicator
        self.failed: Optional[BaseException] = None
        self.draining = False
        self._cond = threading.Condition()
        self._incoming: list = []  # (request, sink)
        self._adding: list = []  # requests taken from `_incoming` that the loop has not queued yet
        self._cancels: list = []
        self._sinks: dict[Any, Sink] = {}
        self._stop = False
        self._graphs = loop.engine.graph_count()
        self._spec: dict = {}  # speculative decoding's counters as last reported
        self._prefix = (0, 0)  # the prefix cache's queries and hits already counted
        self._preempted = 0  # the loop's preemptions already counted
        if metrics is not None and self._graphs:  # "since start": what --precompile compiled counts too
            metrics.graphs.inc(self._graphs)
        self.thread = threading.Thread(target=self._run, name="staticformers-engine", daemon=True)

    def start(self) -> "EngineThread":
        self.thread.start()
        return self

    # ---- from the HTTP side ------------------------------------------------------------------------
    def submit(self, items: list) -> None:
        """Queue `(GenerationRequest, Sink)` pairs (validated by the caller: `loop.validate`), all or none."""
        with self._cond:
            if self.failed is not None:
                raise EngineFailed(str(self.failed))
            if self.draining:
                raise Draining()
            if self.waiting + len(items) > self.max_queued:
                raise QueueFull()
            self._incoming.extend(items)
            self._cond.notify()

    def cancel(self, request_id: Any) -> None:
        with self._cond:
            self._cancels.append(request_id)
            self._cond.notify()

    def uses_adapter(self, name: str) -> bool:
        """Whether a request submitted, waiting or running names adapter `name`."""
        with self._cond:
            if any(r.adapter == name for r, _ in self._incoming) or any(r.adapter == name for r in self._adding):
                return True
        return self.loop.uses_adapter(name)

    @property
    def waiting(self) -> int:
        return len(self._incoming) + self.loop.num_waiting

    @property
    def running(self) -> int:
        return self.loop.running

    def shutdown(self, grace: float = 30.0) -> None:
        """Refuse new requests, give the running ones `grace` seconds, cancel the rest, stop the thread."""
        with self._cond:
            self.draining = True
        deadline = time.monotonic() + grace
        while self.thread.is_alive() and time.monotonic() < deadline:
            with self._cond:
                if not self._incoming and self.loop.idle:
                    break
            time.sleep(0.02)
        with self._cond:
            left = [r.request_id for r, _ in self._incoming] + list(self._sinks)
            self._stop = True
            for request_id in left:
                self._cancels.append(request_id)
            self._cond.notify()
        self.thread.join(timeout=max(grace, 5.0))

    # ---- the thread ----------------------------------------------------------------------------------
    def _take(self) -> Command:
        with self._cond:
            while not self._incoming and not self._cancels and self.loop.idle and not self._stop:
                if not self._cond.wait(timeout=HEARTBEAT_SECONDS) and self.replicator is not None:
                    self.replicator.send(Command())  # keeps the other ranks' collectives from timing out
            command = Command(adds=[r for r, _ in self._incoming], cancels=self._cancels, stop=self._stop)
            for request, sink in self._incoming:
                self._sinks[request.request_id] = sink
            self._incoming, self._cancels = [], []
            self._adding = list(command.adds)  # until the loop holds them (`_run`): an unload waits for them too
        return command

    def _run(self) -> None:
        try:
            while True:
                command = self._take()
                for request in command.adds:
                    self._add(request)
                with self._cond:
                    self._adding = []
                for request_id in command.cancels:
                    if self.loop.cancel(request_id):
                        sink = self._sinks.pop(request_id, None)
                        if sink is not None:
                            sink.put(TokenEvent(request_id, None, 0, "abort"))
                command.step = not self.loop.idle
                command.stop = command.stop and self.loop.idle
                if self.replicator is not None:
                    self.replicator.send(command)
                if command.stop:
                    break
                if command.step:
                    try:
                        events = self.loop.step()
                    except Exception as exc:  # the loop's batch is lost, not the server
                        logger.exception("a generation step failed outside the loop's own recovery")
                        events = self.loop.abandon(exc)
                    self._dispatch(events)
        except BaseException as exc:  # the thread is dying: nobody may wait forever
            logger.exception("the engine thread stopped")
            self.failed = exc
            with self._cond:
                sinks = list(self._sinks.items()) + [(r.request_id, s) for r, s in self._incoming]
                self._sinks, self._incoming = {}, []
            for request_id, sink in sinks:
                sink.put(TokenEvent(request_id, None, 0, "error", error=exc))
        finally:
            self.loop.close()

    def _add(self, request: GenerationRequest) -> None:
        try:
            self.loop.add(request)
        except Exception as exc:  # validated by the handler already; should it still fail, it fails alone
            logger.exception("the loop refused a request")
            self._dispatch([TokenEvent(request.request_id, None, 0, "error", error=exc)])

    def _dispatch(self, events: list) -> None:
        for event in events:
            sink = self._sinks.get(event.request_id)
            if sink is None:
                continue
            sink.put(event)
            if event.finish_reason is not None:
                self._sinks.pop(event.request_id, None)
        if self.metrics is not None:
            m = self.metrics
            m.running.set(self.loop.running)
            m.waiting.set(self.waiting)
            m.padding.set(self.loop.padding_slots)
            blocks = getattr(self.loop, "blocks", None)  # block caches: the pool's use and preemptions
            if blocks is not None:
                m.kv_usage.set(self.loop.kv_usage)
                m.preemptions.inc(self.loop.preemptions - self._preempted)
                self._preempted = self.loop.preemptions
            counts = self.loop.prefix_counts() if hasattr(self.loop, "prefix_counts") else None
            if counts is not None:  # tokens, as vLLM counts them
                m.prefix_queries.inc(counts[0] - self._prefix[0])
                m.prefix_hits.inc(counts[1] - self._prefix[1])
                self._prefix = counts
            graphs = self.loop.engine.graph_count()
            if graphs > self._graphs:
                m.graphs.inc(graphs - self._graphs)
            self._graphs = graphs
            spec = getattr(self.loop, "speculator", None)  # a loop without speculative decoding has none
            if spec is not None:  # counters since start: add what the loop counted since the last events
                for counter, total, key in (
                    (m.spec_draft_tokens, spec.num_draft_tokens, "draft"),
                    (m.spec_accepted_tokens, spec.num_accepted_tokens, "accepted"),
                ):
                    counter.inc(total - self._spec.get(key, 0))
                    self._spec[key] = total


__all__ = ["EngineThread", "Sink", "Command", "QueueFull", "Draining", "EngineFailed"]
