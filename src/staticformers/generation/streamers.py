"""Streaming detokenisation: text out as tokens arrive, never half a character, equal to `decode` at the end.

`generate(streamer=...)` calls `streamer.put(ids)` once with the prompt ([1, n] or [n]), then once per
step with the new token(s), then `streamer.end()` -- the transformers protocol.

`IncrementalDecoder` turns ids into text pieces. It decodes a short window of ids (`ids[prefix:]`)
and emits what the window's text adds to the text of its first part (`ids[prefix:read]`), the scheme
of the Rust `DecodeStream`: decoders join tokens by concatenation (byte-level BPE), or treat only the
first token of the window specially (Metaspace, `Strip`), so the difference is exact while each step
costs a few tokens, not the whole sequence. A piece that ends in U+FFFD (an incomplete UTF-8
sequence, from byte-level tokens) is held back until the character completes; with a ByteFallback
decoder (Llama 2, Mistral) nothing is emitted inside a run of `<0xHH>` tokens, because that decoder
turns a whole run into U+FFFD when the run ends mid-character.
`finish()` decodes the whole sequence once and emits whatever is still missing, so the pieces always
join to exactly `tokenizer.decode(all_ids, **decode_kwargs)`.

When decode post-processes text (transformers' `clean_up_tokenization_spaces`, e.g. " ." -> "."), a
later token can change earlier text, so the decoder re-decodes the whole sequence and emits only up
to the last whitespace, which clean-up never moves text across.

`TextStreamer` prints pieces; `TextIteratorStreamer` queues them for another thread to iterate.
"""

from __future__ import annotations

import abc
from queue import Queue
from typing import Any

_REPLACEMENT = "\ufffd"


def _ids_of(value: Any) -> list[int]:
    """Token ids from a tensor or list of shape [n] or [1, n]."""
    shape = getattr(value, "shape", None)
    if shape is not None and len(shape) > 1:
        if shape[0] > 1:
            raise ValueError(
                f"Streamers handle batch size 1 only, but got ids of shape {tuple(shape)}; "
                "stream one sequence at a time."
            )
        value = value[0]
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, int):
        return [value]
    if value and isinstance(value[0], list):
        if len(value) > 1:
            raise ValueError(
                f"Streamers handle batch size 1 only, but got {len(value)} sequences; stream one sequence at a time."
            )
        value = value[0]
    return [int(i) for i in value]


class IncrementalDecoder:
    """Ids in, text pieces out; the pieces join to `tokenizer.decode(ids, **decode_kwargs)`."""

    def __init__(self, tokenizer: Any, **decode_kwargs: Any) -> None:
        self.tokenizer = tokenizer
        self.decode_kwargs = decode_kwargs
        self.ids: list[int] = []
        self.emitted = 0  # characters emitted so far (of the whole decode)
        self._text_parts: list[str] = []
        self._prefix = 0  # window start
        self._read = 0  # ids up to here are accounted for in emitted text
        self._prefix_text = ""
        cleanup = getattr(tokenizer, "_cleanup_active", None)
        self._whole = bool(cleanup(decode_kwargs.get("clean_up_tokenization_spaces"))) if callable(cleanup) else True
        byte_ids = getattr(tokenizer, "_byte_fallback_ids", None)
        self._byte_ids = byte_ids() if callable(byte_ids) else frozenset()

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, **self.decode_kwargs)

    def _emit(self, text: str) -> str:
        if text:
            self._text_parts.append(text)
            self.emitted += len(text)
        return text

    def push(self, ids: list[int]) -> str:
        """Add ids; return the new text that is final (possibly empty)."""
        self.ids.extend(ids)
        if self._byte_ids and self.ids and self.ids[-1] in self._byte_ids:
            return ""  # inside a ByteFallback run: its text is known only when the run ends
        if self._whole:
            text = self._decode(self.ids)
            cut = max(text.rfind(" "), text.rfind("\n"), text.rfind("\t"))
            stable = text[:cut] if cut > 0 else ""
            while stable.endswith(_REPLACEMENT):
                stable = stable[:-1]
            if len(stable) > self.emitted and stable.startswith(self.text):
                return self._emit(stable[self.emitted :])
            return ""
        text = self._decode(self.ids[self._prefix :])
        if (
            len(text) > len(self._prefix_text)
            and not text.endswith(_REPLACEMENT)
            and text.startswith(self._prefix_text)
        ):
            new = text[len(self._prefix_text) :]
            self._prefix, self._read = self._read, len(self.ids)
            self._prefix_text = self._decode(self.ids[self._prefix : self._read])
            return self._emit(new)
        return ""

    def finish(self) -> str:
        """Emit whatever the whole decode has beyond the pieces already emitted."""
        full = self._decode(self.ids)
        done = self.text
        if not full.startswith(done):  # cannot happen for the decoders above; never lose text
            common = 0
            while common < min(len(full), len(done)) and full[common] == done[common]:
                common += 1
            return self._emit(full[common:])
        return self._emit(full[len(done) :])

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._text_parts) > 1:
            self._text_parts = ["".join(self._text_parts)]
        return self._text_parts[0] if self._text_parts else ""


class BaseStreamer(abc.ABC):
    """What `generate(streamer=...)` calls: `put(ids)` per step, `end()` once."""

    @abc.abstractmethod
    def put(self, value: Any) -> None: ...

    @abc.abstractmethod
    def end(self) -> None: ...


class TextStreamer(BaseStreamer):
    """Print text to stdout as tokens arrive (transformers' `TextStreamer`), never half a character.

    `skip_prompt=True` leaves out the prompt ids that `generate` puts first; other keyword arguments
    (`skip_special_tokens=True`, ...) go to `tokenizer.decode`.
    """

    def __init__(self, tokenizer: Any, skip_prompt: bool = False, **decode_kwargs: Any) -> None:
        self.tokenizer = tokenizer
        self.skip_prompt = skip_prompt
        self.decode_kwargs = decode_kwargs
        self.next_tokens_are_prompt = True
        self._decoder = IncrementalDecoder(tokenizer, **decode_kwargs)

    def put(self, value: Any) -> None:
        ids = _ids_of(value)
        if self.skip_prompt and self.next_tokens_are_prompt:
            self.next_tokens_are_prompt = False
            return
        self.next_tokens_are_prompt = False
        text = self._decoder.push(ids)
        if text:
            self.on_finalized_text(text)

    def end(self) -> None:
        text = self._decoder.finish()
        self._decoder = IncrementalDecoder(self.tokenizer, **self.decode_kwargs)
        self.next_tokens_are_prompt = True
        self.on_finalized_text(text, stream_end=True)

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        """Print new text; a newline at the end of the stream."""
        print(text, flush=True, end="" if not stream_end else None)


class TextIteratorStreamer(TextStreamer):
    """Queue text as tokens arrive, for a consumer that iterates (a server thread while `generate` runs).

    `timeout` (seconds) bounds each wait; `queue.Empty` is raised when it passes, so a consumer is not
    stuck forever if generation fails in its thread.
    """

    def __init__(
        self, tokenizer: Any, skip_prompt: bool = False, timeout: float | None = None, **decode_kwargs: Any
    ) -> None:
        super().__init__(tokenizer, skip_prompt, **decode_kwargs)
        self.text_queue: Queue = Queue()
        self.stop_signal = None
        self.timeout = timeout

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        if text:
            self.text_queue.put(text, timeout=self.timeout)
        if stream_end:
            self.text_queue.put(self.stop_signal, timeout=self.timeout)

    def __iter__(self) -> "TextIteratorStreamer":
        return self

    def __next__(self) -> str:
        value = self.text_queue.get(timeout=self.timeout)
        if value is self.stop_signal:
            raise StopIteration
        return value


__all__ = ["BaseStreamer", "IncrementalDecoder", "TextIteratorStreamer", "TextStreamer"]
