"""Driving a GenerationLoop in tests: requests arrive at chosen steps, every token is collected by request."""

from __future__ import annotations


def run_loop_events(loop, arrivals: dict, max_steps: int = 10_000) -> dict:
    """Step the loop; `arrivals[step]` is a list of requests added before that step. Returns id -> events;
    an error event fails the test, and so does a loop still busy after `max_steps` steps."""
    out: dict = {}
    step = 0
    while arrivals or not loop.idle:
        for request in arrivals.pop(step, []):
            loop.add(request)
        for event in loop.step():
            assert event.error is None, event.error
            out.setdefault(event.request_id, []).append(event)
        step += 1
        assert step < max_steps
    return out


def run_loop(loop, arrivals: dict, max_steps: int = 10_000) -> dict:
    """`run_loop_events`, each request's tokens only: id -> tokens."""
    return {rid: [e.token for e in events] for rid, events in run_loop_events(loop, arrivals, max_steps).items()}
