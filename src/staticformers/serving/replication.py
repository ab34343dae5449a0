"""Tensor-parallel serving: every rank runs the same steps of the generation loop on its shards.

Rank 0 serves HTTP and owns the scheduling; before each step it broadcasts what changed (requests
added, requests cancelled, whether to step, whether to stop) with `torch.distributed`
(`broadcast_object_list` on the default group), and the other ranks apply exactly that to their own
loop and step with it (`Follower`). Every rank therefore holds the same rows in the same slots and
runs the same graph on the same shapes; the sharded layers' collectives line up by construction.
Sampling agrees across ranks because each request's generator is seeded from its request, and rows
without a seed draw from torch's global generator, seeded identically on every rank at start-up and
advanced by the same steps. An idle rank 0 broadcasts an empty command now and then, so the other
ranks' waiting collective never times out.
"""

from __future__ import annotations

import logging

import torch.distributed as dist

from ..generation.loop import GenerationLoop
from .engine_thread import Command

logger = logging.getLogger("staticformers")


class Replicator:
    """Rank 0's side: `send(command)` before every change to its loop."""

    def send(self, command: Command) -> None:
        dist.broadcast_object_list([command], src=0)


class Follower:
    """Every other rank's side: mirror rank 0's loop until it says stop."""

    def __init__(self, loop: GenerationLoop):
        self.loop = loop

    def run(self) -> None:
        try:
            while True:
                box = [None]
                dist.broadcast_object_list(box, src=0)
                command: Command = box[0]
                for request in command.adds:
                    self.loop.add(request)
                for request_id in command.cancels:
                    self.loop.cancel(request_id)
                if command.stop:
                    break
                if command.step:
                    for event in self.loop.step():
                        if event.error is not None:
                            logger.error(
                                "rank %d: request %s failed: %s", dist.get_rank(), event.request_id, event.error
                            )
        finally:
            self.loop.close()


__all__ = ["Replicator", "Follower"]
