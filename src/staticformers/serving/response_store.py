"""The Responses API's stored responses, for `previous_response_id`: bounded, in memory, oldest out first.

Why bounded: a server that kept every response would grow without limit. The store holds at most
`--responses-store-size` responses (`store: true`, OpenAI's default); one more evicts the oldest stored
(first in, first out, whether it was read or not), and a request naming an evicted or unknown id gets a
404 that says so. Nothing survives a restart. Each entry keeps the conversation as chat messages (what
the next request continues from) and the response object (`GET /v1/responses/{id}`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional


@dataclass
class StoredResponse:
    messages: list  # the conversation up to and including this response's output, as chat messages
    response: dict  # the response object as answered


class ResponseStore:
    """At most `size` responses (0: none stored); the oldest goes first (see the module docstring)."""

    def __init__(self, size: int = 1024):
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"The responses store size {size!r} must be a non-negative integer.")
        self.size = size
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, entry: StoredResponse) -> None:
        if self.size == 0:
            return
        with self._lock:
            self._items[response_id] = entry
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> Optional[StoredResponse]:
        with self._lock:
            return self._items.get(response_id)

    def __len__(self) -> int:
        return len(self._items)


__all__ = ["ResponseStore", "StoredResponse"]
