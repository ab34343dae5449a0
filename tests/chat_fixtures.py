"""Training chat templates (with `{% generation %}` blocks) and conversations for the chat tests.

`QWEN_TRAINING_TEMPLATE` is a Qwen3-style training template: the assistant's reasoning (`<think>`),
text, tool calls and end-of-turn token sit inside `{% generation %}`; system, user and tool turns
and the `<|im_start|>assistant\\n` header sit outside. The edge-case templates put block edges in
the middle of what the tokenizer merges into one token, inside a macro, or leave a block empty.
The conversations use the tokenizers of `tokenizer_fixtures.py` (their `<|im_start|>` /
`<|im_end|>` tokens).
"""

from __future__ import annotations

QWEN_TRAINING_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object within <tool_call></tool_call> tags.<|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = message.reasoning_content if message.reasoning_content is string else '' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- generation %}
        {{- '<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
        {%- endgeneration %}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
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

# Block edges inside merged tokens: "Assistant:" + " " + text, the block starting at the space (which
# byte-level BPE merges with the next word), and ending before the newline.
PLAIN_TRAINING_TEMPLATE = """{%- for message in messages %}
    {%- if message.role == 'assistant' %}
        {{- 'Assistant:' }}{% generation %}{{ ' ' + message.content }}{% endgeneration %}{{ '\\n' }}
    {%- else %}
        {{- 'User: ' + message.content + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"""

# A block inside a macro (its output is buffered, so its span is measured where the macro is called),
# and an empty block inside every user turn.
MACRO_TRAINING_TEMPLATE = """{%- macro answer(text) -%}
{% generation %}{{ text }}<|im_end|>{% endgeneration %}
{%- endmacro -%}
{%- for message in messages %}
    {%- if message.role == 'assistant' %}
        {{- '<|im_start|>assistant\n' + answer(message.content) + '\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' }}{% generation %}{% endgeneration %}
        {{- message.content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}"""

TRAINING_TEMPLATES = {
    "qwen3": QWEN_TRAINING_TEMPLATE,
    "plain": PLAIN_TRAINING_TEMPLATE,
    "macro": MACRO_TRAINING_TEMPLATE,
}

WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city, in °C",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]

CONVERSATIONS = [
    [
        {"role": "user", "content": "Hello! Café 你好 😀"},
        {"role": "assistant", "content": "Hello there, how are you doing today?"},
    ],
    [
        {"role": "system", "content": "You are terse.\tTabs\r\nCRLF"},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "\nadd them\n"},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6", "reasoning_content": "three and three"},
    ],
    [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "I should call the tool.",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": '{"temp": 21}'},
        {"role": "assistant", "content": "It is 21 °C in Paris."},
    ],
    [
        {"role": "user", "content": "Two calls at once?"},
        {
            "role": "assistant",
            "content": "Sure.",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
            ],
        },
        {"role": "tool", "content": "20"},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "Rome 20, Oslo 5."},
    ],
]
