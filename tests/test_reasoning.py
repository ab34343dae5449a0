"""`--reasoning-parser qwen3` with Qwen3's published chat template: `<think>...</think>` comes back as
`reasoning_content` and the rest as `content`, whole and streamed (the deltas join to the whole answer's);
`chat_template_kwargs` reaches the template (`enable_thinking: false` writes the empty block, and the answer
is all content); a structured output constrains only the answer after the reasoning."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
pytest.importorskip("fastapi")

from staticformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from staticformers.serving.reasoning import ReasoningSplitter, prompt_state  # noqa: E402
from staticformers.serving.server import ServeOptions, Server, build_loop, build_state  # noqa: E402

# Qwen3's chat template as published in the Qwen/Qwen3-* checkpoints' tokenizer_config.json
QWEN3_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

THOUGHT = "<think>\nThe user greets me; a short answer.\n</think>\n\nHello! How can I help?"
MESSAGES = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from tiny import save_served

    path = save_served("qwen3", tmp_path_factory.mktemp("reasoning"), positions=512)
    config_file = f"{path}/tokenizer_config.json"
    with open(config_file, encoding="utf-8") as f:
        config = json.load(f)
    config["chat_template"] = QWEN3_TEMPLATE
    with open(config_file, "w", encoding="utf-8") as f:
        json.dump(config, f)
    return path


def start(folder, script=None):
    from staticformers.serving.engine_thread import EngineThread
    from test_server import ScriptedLoop

    model, tok = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    opts = ServeOptions(
        model=folder, served_model_name="tiny", backend="eager", max_batch_size=8, reasoning_parser="qwen3"
    )
    state = build_state(model, tok, build_loop(model, opts), opts)
    if script is not None:  # every request 'generates' the scripted text: what is tested is the HTTP layer
        state.engine.shutdown(0)
        ids = tok(script, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        state.engine = EngineThread(ScriptedLoop(state.engine.loop, ids), state.metrics).start()
    server = Server(state, grace=2.0)
    server.start()
    return server, openai.OpenAI(base_url=server.url + "/v1", api_key="x", timeout=120.0, max_retries=0), tok


@pytest.mark.parametrize(
    "text, state",
    [
        (THOUGHT, "open"),
        ("Plain answer, no thinking.", "open"),
        ("Reasoning already open </think> answer", "reasoning"),
        ("<think>x</think>y", "content"),
        ("<thi", "open"),
        ("<think>cut off", "open"),
    ],
)
def test_the_splitter_streamed_joins_to_the_whole_split(text, state):
    whole = ReasoningSplitter("qwen3", state)
    reasoning, content = whole.feed(text, final=True)
    for step in (1, 2, 5):
        s = ReasoningSplitter("qwen3", state)
        parts = [s.feed(text[i : i + step]) for i in range(0, len(text), step)] + [s.feed("", final=True)]
        assert ("".join(p[0] for p in parts), "".join(p[1] for p in parts)) == (reasoning, content)
        assert s.reasoning == whole.reasoning
    if text == THOUGHT:
        assert (reasoning, content) == ("\nThe user greets me; a short answer.\n", "\n\nHello! How can I help?")
    assert prompt_state("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n") == "content"
    assert prompt_state("qwen3", "<|im_start|>assistant\n<think>\n") == "reasoning"


def test_reasoning_content_and_content_split_whole_and_streamed(folder):
    server, client, tok = start(folder, THOUGHT)
    try:
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=100)
        message = r.choices[0].message
        assert message.reasoning_content == "\nThe user greets me; a short answer.\n"
        assert message.content == "\n\nHello! How can I help?"
        chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=100, stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == message.reasoning_content
        assert "".join(d.content or "" for d in deltas) == message.content
        assert not any(getattr(d, "reasoning_content", None) and d.content for d in deltas)
        # enable_thinking false reaches the template: its empty block is in the prompt, the answer is content
        off = client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=100,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
        rendered = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, enable_thinking=False)
        assert rendered.endswith("<think>\n\n</think>\n\n")
        assert (
            off.usage.prompt_tokens
            == len(tok(rendered, add_special_tokens=False)["input_ids"])
            == r.usage.prompt_tokens + len(tok("<think>\n\n</think>\n\n", add_special_tokens=False)["input_ids"])
        )
        assert off.choices[0].message.content == THOUGHT and off.choices[0].message.reasoning_content is None
    finally:
        server.stop()


def test_a_structured_output_constrains_the_answer_after_the_reasoning(folder):
    server, client, tok = start(folder)
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "ok", "schema": schema, "strict": True}}
    try:  # thinking off: the prompt closed the block, the grammar applies from the first token
        r = client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            n=8,
            temperature=1.0,
            seed=1,
            max_tokens=30,
            response_format=fmt,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
        for c in r.choices:
            jsonschema.validate(json.loads(c.message.content), schema)
            assert c.message.reasoning_content is None
        # thinking on: the random model's thinking is free (not JSON), the grammar waits for </think>
        r = client.chat.completions.create(
            model="tiny", messages=MESSAGES, n=4, temperature=1.0, seed=1, max_tokens=12, response_format=fmt
        )
        texts = [c.message.content or "" for c in r.choices]
        assert not all(t.startswith('{"ok": ') for t in texts), texts
    finally:
        server.stop()
