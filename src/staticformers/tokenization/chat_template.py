"""Chat templates: render a conversation with a model's Jinja template, the way transformers does.

Chat templates come from the Hub and are untrusted code, so they run in jinja2's
`ImmutableSandboxedEnvironment` (jinja2 >= 3.1.6, which closed the known sandbox escapes), bounded in
time and in what it makes (`template_bounds.py`), with the
settings and helpers that templates are written against: `trim_blocks`, `lstrip_blocks`, the
`loopcontrols` extension, `raise_exception`, `strftime_now`, a `tojson` filter that does not escape
HTML (Jinja's own does), a `dict` constructor and a `namespace` that refuses dunder attributes.
`{% generation %}` blocks render their body unchanged; while `render(..., return_spans=True)` runs, each
block also records the character span of its body in the output, measured as transformers measures it
(the length of the text the template had yielded when the block finished), so assistant-token masks
built from the spans (`assistant_masks.py`) equal transformers', edge cases included. The recording
state lives in a context variable, so threads rendering at once never see each other's spans.

Everything a template sees is rebuilt from plain JSON-like data first, so a template cannot reach the
methods of rich objects the caller put in a message. The rendered text is what
`transformers.PreTrainedTokenizerBase.apply_chat_template` renders; the parity tests prove it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes

from .template_bounds import BoundedSandbox, bounded

# Names a message's reasoning is passed under; templates read the first one.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# While a render records spans: (the chunks the template has yielded so far, the spans found so far).
_SPANS: ContextVar[tuple[list[str], list[tuple[int, int]]] | None] = ContextVar("generation_spans", default=None)


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: rendered as its body, its span recorded while spans are asked for."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        body = caller()
        recording = _SPANS.get()
        if recording is not None:
            chunks, spans = recording
            start = sum(len(chunk) for chunk in chunks)
            spans.append((start, start + len(body)))
        return body


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Jinja's built-in `tojson` escapes HTML characters; templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` inside templates, without exposing the `dict` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore-prefixed attributes (a path to CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as jinja2's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace ({name!r}); rename it."
            )


@lru_cache(maxsize=64)
def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template once (cached by its text) in the sandboxed environment."""
    if _version_tuple(jinja2.__version__) < (3, 1, 6):
        raise ImportError(
            f"Chat templates need jinja2>=3.1.6 (older versions have sandbox escapes) but {jinja2.__version__} "
            "is installed: run `pip install -U jinja2`."
        )
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as err:
        raise ValueError(
            f"The chat template has a Jinja syntax error at line {err.lineno}: {err.message}; fix the template."
        ) from err


def plain_data(value: Any) -> Any:
    """Rebuild `value` from plain JSON types, so a template never touches a caller's rich objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_data(key): plain_data(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain_data(item) for item in value]
    if isinstance(value, tuple):
        return tuple(plain_data(item) for item in value)
    if hasattr(value, "item") and callable(value.item) and getattr(value, "shape", None) == ():
        return plain_data(value.item())  # numpy / torch scalars
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return plain_data(value.model_dump())
    return f"<{type(value).__name__}>"


def _alias_reasoning(chat: list[dict]) -> list[dict]:
    out = []
    for message in chat:
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _tool_schemas(tools: list | None) -> list | None:
    if tools is None:
        return None
    schemas = []
    for tool in tools:
        if not isinstance(tool, Mapping):
            raise ValueError(
                f"Each tool must be a JSON schema dict (got {type(tool).__name__}); describe functions as "
                '{"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}.'
            )
        schemas.append(tool)
    return schemas


def render(
    template: str,
    conversations: list[list[dict]],
    *,
    tools: list | None = None,
    documents: list | None = None,
    add_generation_prompt: bool = False,
    continue_final_message: bool | str = False,
    template_kwargs: dict[str, Any] | None = None,
    return_spans: bool = False,
) -> list[str] | tuple[list[str], list[list[tuple[int, int]]]]:
    """Render each conversation with `template`; returns one string per conversation.

    With `return_spans=True` it returns `(texts, spans)`: for each conversation the `(start, end)`
    character spans of its `{% generation %}` blocks, in the order they were rendered.
    """
    compiled = compile_template(template)
    if documents is not None and not all(isinstance(d, Mapping) for d in documents):
        raise TypeError("Documents must be a list of dicts with 'title' and 'text' keys.")
    tool_schemas = plain_data(_tool_schemas(tools))
    documents = plain_data(documents)
    kwargs = plain_data(dict(template_kwargs or {}))

    rendered, all_spans = [], []
    for chat in conversations:
        chat = plain_data(list(chat))
        for message in chat:
            if not isinstance(message, dict):
                raise TypeError(f"Chat messages must be dicts with 'role' and 'content' keys, but got {message!r}.")
        chat = _alias_reasoning(chat)
        final_text: Any = None
        if continue_final_message:
            field = continue_final_message if isinstance(continue_final_message, str) else "content"
            final_text = chat[-1].get(field)
            if final_text is None:
                raise ValueError(f'continue_final_message is set but the final message has no "{field}" to continue.')
            fields = [field]
            if field in _REASONING_FIELDS:
                fields = [f for f in _REASONING_FIELDS if chat[-1].get(f) == final_text]
            if not any(f in template for f in fields):
                raise ValueError(
                    f'continue_final_message names "{field}", which the chat template never reads; '
                    "pass the field the template uses (usually 'content')."
                )
            if isinstance(final_text, (list, tuple)):
                for block in reversed(final_text):
                    if isinstance(block, dict) and "text" in block:
                        final_text = block["text"]
                        block["text"] = block["text"] + _CONTINUE_TAG
                        break
                else:
                    raise ValueError(
                        "continue_final_message is set but the final message has no text block to continue."
                    )
            else:
                for f in fields:
                    chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
        variables = dict(
            messages=chat,
            tools=tool_schemas,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
        if return_spans:
            text, spans = _render_recording_spans(compiled, variables)
            all_spans.append(spans)
        else:
            text = "".join(bounded(compiled.generate(**variables)))
        if continue_final_message:
            if final_text.strip() not in text or _CONTINUE_TAG.strip() not in text:
                raise ValueError(
                    "continue_final_message is set but the chat template dropped part of the final message, so it "
                    "cannot be continued; check that the template renders the last message as given."
                )
            at = text.rindex(_CONTINUE_TAG.strip())
            text = text[:at] if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
        rendered.append(text)
    return (rendered, all_spans) if return_spans else rendered


def _render_recording_spans(compiled: jinja2.Template, variables: dict) -> tuple[str, list[tuple[int, int]]]:
    chunks: list[str] = []
    spans: list[tuple[int, int]] = []
    token = _SPANS.set((chunks, spans))
    try:
        for chunk in bounded(compiled.generate(**variables)):
            chunks.append(chunk)
    finally:
        _SPANS.reset(token)
    return "".join(chunks), spans
