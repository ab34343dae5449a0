"""Which request fields the server honours, per endpoint, in one table; every other field is refused.

OpenAI's rule, and vLLM's with `extra="forbid"`-style checks, is to refuse what a server cannot honour
rather than answer as if it had: a field that would change the answer (vLLM's `guided_json`, OpenAI's
`functions`, `use_beam_search`, ...) and is silently dropped gives a 200 with a wrong answer. So each
endpoint lists what it reads (`HONOURED`), the fields that only describe the client and change no
answer pass on every endpoint (`DESCRIPTIVE`), and anything else is a 400 naming every such field.

To support a new field: read it in `protocol.py` (or the route) and add its name here, in the group of
the endpoints that read it. `HINTS` says what to send instead, where there is an answer.
"""

from __future__ import annotations

from typing import Optional

# the fields that only describe the client or the request's bookkeeping: accepted and unused
DESCRIPTIVE = frozenset(
    {"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier", "request_id"}
)

_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "seed",
    "n",
    "best_of",
    "logit_bias",
    "skip_special_tokens",
)
_GENERATION = ("model", "stream", "stream_options", "response_format", "structured_outputs", "max_tokens") + _SAMPLING
_TEMPLATE = ("messages", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs", "add_generation_prompt")

# endpoint -> the fields it reads (a field whose unsupported values it refuses itself counts as read)
HONOURED = {
    "completion": frozenset(_GENERATION + ("prompt", "logprobs", "echo", "suffix")),
    "chat": frozenset(_GENERATION + _TEMPLATE + ("max_completion_tokens", "logprobs", "top_logprobs")),
    "tokenize": frozenset(("model", "prompt", "add_special_tokens") + _TEMPLATE),
    "detokenize": frozenset(("model", "tokens")),
    # /v1/responses (`responses_input.py`); `include` and `truncation` ask for nothing this server would
    # add or cut, `parallel_tool_calls` is chat's
    "responses": frozenset(
        (
            "model",
            "input",
            "instructions",
            "previous_response_id",
            "max_output_tokens",
            "temperature",
            "top_p",
            "tools",
            "tool_choice",
            "stream",
            "text",
            "parallel_tool_calls",
            "include",
            "truncation",
        )
    ),
}

# what to send instead of a refused field, where there is something
HINTS = {
    "functions": 'send "tools" instead',
    "function_call": 'send "tool_choice" instead',
    "max_new_tokens": 'send "max_tokens" instead',
    "do_sample": 'send "temperature" (0 for greedy) instead',
}


def refusal(body: dict, endpoint: str) -> Optional[tuple[str, str]]:
    """(the sentence, the first field) refusing a body that holds fields `endpoint` does not honour, naming
    each of them; None when every field is honoured or descriptive (`protocol.check_fields` raises it)."""
    known = HONOURED[endpoint]
    unknown = [k for k in body if k not in known and k not in DESCRIPTIVE]
    if not unknown:
        return None
    names = ", ".join(repr(k) for k in unknown)
    hints = "; ".join(f"for {k!r}, {HINTS[k]}" for k in unknown if k in HINTS)
    several = len(unknown) > 1
    return (
        f"The field{'s' if several else ''} {names} {'are' if several else 'is'} not supported by this server "
        f"and would change the answer: leave {'them' if several else 'it'} out{f' ({hints})' if hints else ''}.",
        unknown[0],
    )


__all__ = ["DESCRIPTIVE", "HINTS", "HONOURED", "refusal"]
