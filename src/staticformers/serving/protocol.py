"""OpenAI's request bodies, checked field by field, turned into what the generation loop takes.

Why by hand rather than with pydantic models: every refusal must be OpenAI's error JSON with HTTP 400
and a sentence naming the field and its value (`ApiError`), and fields we cannot honour must be
refused, not silently ignored: `fields.py` lists what each endpoint reads and the fields that only
describe the client (`user`, `metadata`, `store`, ...), and `check_fields` refuses any other. Defaults
follow OpenAI, with the checkpoint's `generation_config.json` for the sampling defaults, as vLLM does.

`parse_completion` / `parse_chat` return a `Job`: the prompts as token ids, one `Choice` per
generated sequence (prompt x `n`) with its `SamplingParams`, and what the response needs (stop
strings, logprobs, streaming options, echo, tools).
"""

from __future__ import annotations

import math
import re
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

from ..generation.constraints import StructuredOutputs
from ..generation.sampling import SamplingParams
from . import fields

MAX_STOP = 16  # stop strings per request (OpenAI allows 4; longer lists only cost matching time)


class ApiError(Exception):
    """An error answered in OpenAI's format: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        param: Optional[str] = None,
        kind: str = "invalid_request_error",
        code: Optional[str] = None,
        headers: Optional[dict] = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def invalid(param: str, value: Any, must: str) -> ApiError:
    return ApiError(400, f"{param}={value!r} {must}.", param=param)


def check_fields(body: dict, endpoint: str) -> None:
    """Refuse (400) every field of `body` that `endpoint` does not honour (the table is `fields.py`)."""
    refused = fields.refusal(body, endpoint)
    if refused is not None:
        raise ApiError(400, refused[0], param=refused[1], code="unsupported_field")


@dataclass
class Choice:
    """One sequence to generate: which prompt, its index in the response, its settings."""

    index: int
    prompt_index: int
    sampling: SamplingParams


@dataclass
class Job:
    """A parsed request: see the module docstring."""

    kind: str  # "completion" or "chat"
    model: Optional[str]
    prompts: list  # list[list[int]]
    prompt_texts: list  # the prompts as text (echo, chat)
    choices: list
    max_tokens: list  # per prompt
    stop: list = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    logprobs: Optional[int] = None  # top-n per token (0: only the chosen token's), None: none
    echo: bool = False
    skip_special_tokens: bool = True
    tools: Optional[list] = None  # chat: tools given and tool_choice not "none"
    structured: Optional[StructuredOutputs] = None  # the constraint every choice's answer matches
    structured_param: Optional[str] = None  # the field that asked for it (named by a refusal)
    tool_choice: Any = None  # chat: "required" or {"type": "function", ...} forces a call (`tool_grammar.py`)
    parallel_tool_calls: bool = True
    reasoning: Optional[str] = None  # chat with a reasoning parser: where the answer starts (`reasoning.prompt_state`)


# ---------------------------------------------------------------------------------------------
# field checks
# ---------------------------------------------------------------------------------------------
def _number(body: dict, name: str, low: float, high: float, default=None, low_open: bool = False):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
        raise invalid(name, value, "must be a finite number")
    if value < low or value > high or (low_open and value == low):
        raise invalid(name, value, f"must be in {'(' if low_open else '['}{low}, {high}]")
    return float(value)


def _finite(value) -> bool:
    """Whether a JSON number is a finite float (an integer past a float's range is not: 10**400)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


INT64_MAX = 2**63 - 1  # the widest integer any field reaches the engine as (a torch.long)


def _integer(body: dict, name: str, low: int, high: Optional[int] = None, default=None):
    """An integer field in [low, high]; with no `high`, in [low, INT64_MAX] (a bigger one cannot reach the
    engine, which holds it in 64 bits)."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(name, value, "must be an integer")
    if value < low or (high is not None and value > high):
        raise invalid(
            name, value, f"must be between {low} and {high}" if high is not None else f"must be at least {low}"
        )
    if high is None and value > INT64_MAX:
        raise invalid(name, value, f"must be an integer that fits in 64 bits (at most {INT64_MAX})")
    return value


def _boolean(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(name, value, "must be true or false")
    return value


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise invalid("stop", stop, "must be a string or a list of strings")
    if len(stop) > MAX_STOP:
        raise invalid("stop", f"[{len(stop)} strings]", f"must hold at most {MAX_STOP} strings")
    if any(s == "" for s in stop):
        raise invalid("stop", stop, "must not contain an empty string")
    return list(dict.fromkeys(stop))


def _token_ids(value: Any, name: str, vocab: int) -> list[int]:
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    ):
        raise invalid(name, value, "must be a non-empty list of integer token ids")
    bad = [t for t in value if not 0 <= t < vocab]
    if bad:
        raise invalid(name, bad[:4], f"holds ids outside the vocabulary [0, {vocab})")
    return value


def _refuse(body: dict, name: str, allowed=(None,), why: str = "is not supported") -> None:
    value = body.get(name)
    if value not in allowed and not (isinstance(value, (dict, list)) and not value):
        raise invalid(name, value, why)


def _sampling(body: dict, defaults: dict, eos: list[int], vocab: int, logprobs: Optional[int]) -> tuple[dict, list]:
    """The settings shared by a request's choices (the seed is set per choice)."""
    temperature = _number(body, "temperature", 0.0, 2.0, defaults.get("temperature", 1.0))
    top_p = _number(body, "top_p", 0.0, 1.0, defaults.get("top_p"), low_open=True)
    top_k = _integer(body, "top_k", -1, None, defaults.get("top_k"))
    top_k = min(top_k, vocab) if top_k is not None else None  # a k past the vocabulary keeps every token
    min_p = _number(body, "min_p", 0.0, 1.0, defaults.get("min_p"))
    presence = _number(body, "presence_penalty", -2.0, 2.0)
    frequency = _number(body, "frequency_penalty", -2.0, 2.0)
    repetition = _number(body, "repetition_penalty", 0.0, 10.0, defaults.get("repetition_penalty"), low_open=True)
    min_tokens = _integer(body, "min_tokens", 0, None, 0)
    stop_ids = body.get("stop_token_ids")
    stop_ids = _token_ids(stop_ids, "stop_token_ids", vocab) if stop_ids not in (None, []) else []
    ignore_eos = _boolean(body, "ignore_eos", False)
    greedy = temperature == 0.0
    settings = dict(
        do_sample=not greedy,
        temperature=None if greedy else temperature,
        top_k=top_k if top_k and top_k > 0 else None,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=repetition,
        presence_penalty=presence,
        frequency_penalty=frequency,
        min_new_tokens=min_tokens,
        logprobs=logprobs,
    )
    stops = list(dict.fromkeys(([] if ignore_eos else list(eos)) + list(stop_ids)))
    return settings, stops


def _choices(body: dict, prompts: int, settings: dict, stop_ids: list, max_n: int) -> list[Choice]:
    n = _integer(body, "n", 1, max_n, 1)
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise invalid("best_of", best_of, f"is not supported beyond n (pass best_of={n} or leave it out)")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**64):
        raise invalid("seed", seed, "must be an integer that fits in 64 bits")
    out = []
    for p in range(prompts):
        for i in range(n):
            index = p * n + i
            out.append(
                Choice(
                    index,
                    p,
                    SamplingParams(
                        **settings, eos_token_ids=stop_ids, seed=(seed + index) % 2**64 if seed is not None else None
                    ),
                )
            )
    return out


def _max_tokens(body: dict, names: tuple, default: Optional[int], low: int = 1) -> Optional[int]:
    for name in names:
        if body.get(name) is not None:
            return _integer(body, name, low)
    return default


def _fit(prompts: list, asked: Optional[int], max_model_len: int, name: str) -> list[int]:
    """Tokens each prompt may generate: what was asked (or all that fit), refused with both numbers when
    the prompt plus the answer exceed the model's length."""
    out = []
    for ids in prompts:
        room = max_model_len - len(ids)
        if room < 1:
            raise ApiError(
                400,
                f"The prompt has {len(ids)} token{'s' if len(ids) != 1 else ''}, which leaves no room for an answer within "
                f"--max-model-len={max_model_len}: shorten it.",
                param="messages" if name == "chat" else "prompt",
            )
        if asked is not None and len(ids) + asked > max_model_len:
            raise ApiError(
                400,
                f"The prompt has {len(ids)} token{'s' if len(ids) != 1 else ''} and max_tokens={asked}: {len(ids) + asked} exceed "
                f"--max-model-len={max_model_len}; ask for at most {room} tokens.",
                param="max_tokens",
            )
        out.append(asked if asked is not None else room)
    return out


def _common(body: dict) -> tuple[bool, bool]:
    stream = _boolean(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise invalid("stream_options", options, 'must be an object such as {"include_usage": true}')
    if options and set(options) - {"include_usage"}:
        extra = sorted(set(options) - {"include_usage"})[0]
        raise invalid(f"stream_options.{extra}", options[extra], "is not supported: only include_usage is")
    include_usage = bool(options and options.get("include_usage"))
    if options and not stream:
        raise invalid("stream_options", options, "is only allowed with stream=true")
    _refuse(body, "logit_bias", why="is not supported: leave it out")
    _refuse(body, "suffix", why="is not supported: leave it out")
    return stream, include_usage


STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def structured(body: dict) -> tuple[Optional[StructuredOutputs], Optional[str]]:
    """The constraint a body asks for: OpenAI's `response_format` (`json_object`, `json_schema`) or vLLM's
    `structured_outputs` (`json`, `regex`, `choice`, `grammar`, `json_object`), and the field that asked.
    Its content (schema, regex, grammar) is checked when it is compiled (`runs.constraint`)."""
    fmt, extra = body.get("response_format"), body.get("structured_outputs")
    if fmt is not None and extra is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise invalid("structured_outputs", extra, "cannot be combined with response_format: send one of them")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "text":
            pass
        elif kind == "json_object":
            return StructuredOutputs(json_object=True), "response_format"
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise invalid(
                    "response_format.json_schema", spec, 'must be {"name": ..., "schema": {...}, "strict": true}'
                )
            return StructuredOutputs(json=spec.get("schema", {})), "response_format.json_schema.schema"
        else:
            raise invalid("response_format", fmt, 'must have type "text", "json_object" or "json_schema"')
    if extra is None:
        return None, None
    if not isinstance(extra, dict):
        raise invalid("structured_outputs", extra, f"must be an object with one of {', '.join(STRUCTURED_KEYS)}")
    given = {k: v for k, v in extra.items() if v is not None and v is not False}
    unknown = sorted(set(given) - set(STRUCTURED_KEYS))
    if unknown:
        raise invalid(
            f"structured_outputs.{unknown[0]}",
            extra[unknown[0]],
            f"is not supported: use one of {', '.join(STRUCTURED_KEYS)}",
        )
    if len(given) != 1:
        raise invalid("structured_outputs", extra, f"must set exactly one of {', '.join(STRUCTURED_KEYS)}")
    key, value = next(iter(given.items()))
    if key == "json_object" and value is not True:
        raise invalid("structured_outputs.json_object", value, "must be true")
    if key in ("regex", "grammar") and not isinstance(value, str):
        raise invalid(f"structured_outputs.{key}", value, "must be a string")
    if key == "choice" and not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
        raise invalid("structured_outputs.choice", value, "must be a non-empty list of non-empty strings")
    if key == "json" and not isinstance(value, (dict, str)):
        raise invalid("structured_outputs.json", value, "must be a JSON schema (an object or its text)")
    return StructuredOutputs(**{key: value}), f"structured_outputs.{key}"


# ---------------------------------------------------------------------------------------------
# the two endpoints
# ---------------------------------------------------------------------------------------------
def parse_completion(body: Any, tokenizer, defaults: dict, eos: list[int], max_model_len: int, max_n: int) -> Job:
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    check_fields(body, "completion")
    model = body.get("model")
    prompt = body.get("prompt")
    vocab = tokenizer_vocab(tokenizer)
    if prompt is None:
        raise ApiError(400, "prompt is required: pass a string, a list of strings or token ids.", param="prompt")
    if isinstance(prompt, str):
        texts: list = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        texts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        texts = [None]
        prompt = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        texts = [None] * len(prompt)
    else:
        raise invalid("prompt", prompt, "must be a string, a list of strings or a list of token ids")
    if texts[0] is not None:
        for text in texts:
            check_length(text, tokenizer, max_model_len, "prompt")
        ids = [tokenizer(t)["input_ids"] for t in texts]
        ids = [list(i.tolist() if hasattr(i, "tolist") else i) for i in ids]
    else:
        ids = [_token_ids(p, "prompt", vocab) for p in prompt]
        texts = [tokenizer.decode(p) for p in ids]
    empty = [i for i, p in enumerate(ids) if not p]
    if empty:
        raise invalid("prompt", "", "is empty: pass some text")
    stream, include_usage = _common(body)
    logprobs = _integer(body, "logprobs", 0, 20)
    echo = _boolean(body, "echo", False)
    settings, stop_ids = _sampling(body, defaults, eos, vocab, logprobs)
    # echo with logprobs scores the prompt too (the prefill's own output); max_tokens=0 then scores only
    settings["prompt_logprobs"] = logprobs if echo else None
    if body.get("max_tokens") == 0 and not echo:
        raise invalid("max_tokens", 0, "is only allowed with echo=true (to score the prompt): ask for at least 1 token")
    asked = _max_tokens(body, ("max_tokens",), 16, low=0 if echo else 1)
    _check_min_tokens(settings, asked, "max_tokens")
    spec, param = structured(body)
    return Job(
        "completion",
        model,
        ids,
        texts,
        _choices(body, len(ids), settings, stop_ids, max_n),
        _fit(ids, asked, max_model_len, "completion"),
        stop=_stop(body),
        stream=stream,
        include_usage=include_usage,
        logprobs=logprobs,
        echo=echo,
        skip_special_tokens=_boolean(body, "skip_special_tokens", True),
        structured=spec,
        structured_param=param,
    )


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", messages, 'must be a non-empty list of {"role", "content"} objects')
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise invalid(f"messages[{i}]", m, 'must be an object with a "role"')
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise invalid(f"messages[{i}].content", part, "must be text parts (this model reads text only)")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is not None and not isinstance(content, str):
            raise invalid(f"messages[{i}].content", content, "must be a string or a list of text parts")
        message = {k: v for k, v in m.items() if v is not None}
        message["content"] = content if content is not None else ""
        calls = message.get("tool_calls")
        if calls:  # templates take the arguments as objects, as transformers passes them
            message["tool_calls"] = [_template_call(c, i) for c in calls]
        out.append(message)
    return out


TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _tools(tools: Any) -> Optional[list]:
    """`tools` as OpenAI defines them: `{"type": "function", "function": {"name", "description"?,
    "parameters"?}}`, the name of letters, digits, `_` and `-` (64 at most), the parameters a JSON Schema
    object; anything else is refused naming the tool, rather than rendered into the prompt."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise invalid("tools", tools, "must be a list of tool objects")
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise invalid(where, tool, 'must be {"type": "function", "function": {"name": ..., "parameters": {...}}}')
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise invalid(f"{where}.function.name", name, "must be 1 to 64 letters, digits, '_' or '-'")
        if not isinstance(function.get("description", ""), str):
            raise invalid(f"{where}.function.description", function["description"], "must be a string")
        parameters = function.get("parameters")
        if parameters is not None and not (
            isinstance(parameters, dict)
            and parameters.get("type", "object") == "object"
            and isinstance(parameters.get("properties", {}), dict)
            and isinstance(parameters.get("required", []), list)
        ):
            raise invalid(
                f"{where}.function.parameters",
                parameters,
                'must be a JSON Schema object ({"type": "object", "properties": {...}})',
            )
    return tools


def _check_min_tokens(settings: dict, asked: Optional[int], name: str, fitted: Optional[list] = None) -> None:
    """Refuse a min_tokens above what was asked (`asked`), or, with no max_tokens, above the room the
    prompts leave (`fitted`)."""
    low = settings.get("min_new_tokens") or 0
    if asked is not None and low > asked:
        raise invalid("min_tokens", low, f"is more than {name}={asked}: ask for at most {asked}")
    if asked is None and fitted and low > min(fitted):
        raise invalid(
            "min_tokens",
            low,
            f"is more than the {min(fitted)} tokens the prompt leaves within "
            f"--max-model-len: ask for at most {min(fitted)}",
        )


def _template_call(call: Any, i: int) -> dict:
    import json

    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise invalid(f"messages[{i}].tool_calls", call, 'must be OpenAI tool calls ({"function": {...}})')
    function = dict(call["function"])
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise invalid(f"messages[{i}].tool_calls", arguments, "must carry arguments as a JSON object") from None
    return {**{k: v for k, v in call.items() if k != "function"}, "function": function}


def parse_chat(
    body: Any,
    tokenizer,
    defaults: dict,
    eos: list[int],
    max_model_len: int,
    max_n: int,
    chat_template: Optional[str] = None,
    endpoint: str = "chat",
) -> Job:
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    check_fields(body, endpoint)
    messages = _messages(body)
    tools = _tools(body.get("tools"))
    tool_choice = _tool_choice(body.get("tool_choice"), tools)
    if tool_choice == "none":
        tools = None
    parallel = _boolean(body, "parallel_tool_calls", True)
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise invalid("chat_template_kwargs", kwargs, "must be an object")
    add_generation_prompt = _boolean(body, "add_generation_prompt", True)
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=[t.get("function", t) if t.get("type") == "function" else t for t in tools] if tools else None,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **kwargs,
        )
    except (ValueError, TypeError) as err:
        raise ApiError(400, f"The chat template could not render these messages: {err}", param="messages") from None
    except Exception as err:  # a template's own error (raise_exception, undefined variables)
        raise ApiError(400, f"The chat template refused these messages: {err}", param="messages") from None
    check_length(text, tokenizer, max_model_len, "messages")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = list(ids.tolist() if hasattr(ids, "tolist") else ids)
    stream, include_usage = _common(body)
    if _boolean(body, "logprobs", False):
        logprobs = _integer(body, "top_logprobs", 0, 20, 0)
    else:
        if body.get("top_logprobs") not in (None, 0):
            raise invalid("top_logprobs", body.get("top_logprobs"), "needs logprobs=true")
        logprobs = None
    settings, stop_ids = _sampling(body, defaults, eos, tokenizer_vocab(tokenizer), logprobs)
    asked = _max_tokens(body, ("max_completion_tokens", "max_tokens"), None)
    _check_min_tokens(
        settings, asked, "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    )
    fitted = _fit([ids], asked, max_model_len, "chat")
    _check_min_tokens(settings, asked, "max_tokens", fitted)
    spec, param = structured(body)
    forced = tool_choice not in (None, "none", "auto") and bool(tools)
    if forced and spec is not None:
        assert param is not None  # structured() names the field whenever it returns a constraint
        raise invalid(
            param.split(".")[0],
            body.get(param.split(".")[0]),
            "cannot be combined with a forced tool call (tool_choice): send one of them",
        )
    return Job(
        "chat",
        body.get("model"),
        [ids],
        [text],
        _choices(body, 1, settings, stop_ids, max_n),
        fitted,
        stop=_stop(body),
        stream=stream,
        include_usage=include_usage,
        logprobs=logprobs,
        tools=tools or None,
        skip_special_tokens=_boolean(body, "skip_special_tokens", True),
        structured=spec,
        structured_param=param,
        tool_choice=tool_choice if forced else None,
        parallel_tool_calls=parallel,
    )


def _tool_choice(choice: Any, tools: Optional[list]) -> Any:
    """OpenAI's `tool_choice`: "none", "auto", "required" (both need `tools`) or `{"type": "function",
    "function": {"name": ...}}` naming one of the tools."""
    if choice in (None, "none", "auto"):
        return choice
    if choice == "required":
        if not tools:
            raise invalid("tool_choice", choice, "needs tools: pass the tools the model must choose from")
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        names = [t["function"]["name"] for t in tools or []]
        if name not in names:
            raise invalid(
                "tool_choice.function.name", name, f"must name one of the tools ({', '.join(names) or 'none given'})"
            )
        return choice
    raise invalid(
        "tool_choice", choice, 'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
    )


_LONGEST_TOKEN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def longest_token(tokenizer) -> int:
    """The most characters one token of `tokenizer` stands for (its longest vocabulary entry, which for a
    byte-level vocabulary counts bytes, never fewer than characters); computed once per tokenizer."""
    try:
        return _LONGEST_TOKEN[tokenizer]
    except (KeyError, TypeError):
        pass
    longest = max((len(k) for k in tokenizer.get_vocab()), default=1)
    try:
        _LONGEST_TOKEN[tokenizer] = longest
    except TypeError:  # not weakly referable: computed again next time
        pass
    return longest


def check_length(text: str, tokenizer, max_model_len: int, param: str) -> None:
    """Refuse, before tokenizing it, a text with so many characters that its tokens cannot fit the model: at
    least `len(text) / longest_token` tokens (halved again for normalizers that join characters)."""
    bound = 2 * longest_token(tokenizer) * max_model_len
    if len(text) > bound:
        raise ApiError(
            400,
            f"The {'prompt' if param == 'prompt' else 'rendered chat'} has {len(text)} characters, "
            f"far more tokens than --max-model-len={max_model_len} holds: shorten it.",
            param=param,
        )


def tokenizer_vocab(tokenizer) -> int:
    size = getattr(tokenizer, "vocab_size_with_added", None)
    if size is None:
        size = len(tokenizer)
    return int(size)


__all__ = ["ApiError", "Choice", "Job", "parse_completion", "parse_chat"]
