"""Tool calling: chat templates render tool definitions, tool-call messages, tool results and reasoning
byte-identically to transformers' `apply_chat_template` (text and token ids) for the families whose
templates have tools (Qwen2.5 and Qwen3 in Hermes style, Llama 3.1 in JSON style) and for those whose
templates have none (Qwen2, Llama 3, Mistral v0.1/v0.2, Gemma: tools are ignored, as transformers
ignores them); functions become the JSON schemas transformers' `get_json_schema` writes; tool calls are
parsed out of model text, and every malformed call comes back as a value naming what is wrong."""

from __future__ import annotations

import enum
import json
from typing import Any, Literal, Optional, Union

import numpy as np
import pytest

from jaxrlhf.environments.tool_calls import (
    TOOL_CALL_FORMATS,
    ParsedToolCalls,
    ToolCall,
    ToolCallError,
    ToolSchemaError,
    detect_tool_format,
    function_schema,
    parse_tool_calls,
    tool_parameters,
)
from jaxrlhf.models.chat_template import ChatTemplate, ChatTemplateError
from jaxrlhf.models.tokenizer import load_tokenizer
from jaxrlhf.testing.models import save_tiny_tokenizer

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
from transformers.utils import get_json_schema  # noqa: E402

# ---------------------------------------------------------------- templates, in the style of each family's
# tokenizer_config.json (written here).

# Qwen2.5-Instruct: a default system message; with tools, a "# Tools" system block listing each schema as
# JSON inside <tools>; calls as <tool_call> JSON; consecutive tool results folded into one user turn.
QWEN25 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Qwen3: the Hermes tool block, `reasoning_content` (or <think> in the content) shown only after the last
# real user query, tool results that do not count as a query, string arguments written as they are, and
# `enable_thinking=false` prefilling an empty think block.
QWEN3 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
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
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

# Llama 3.1: BOS, a system turn with "Environment: ipython" and the dates (`date_string`), the tools as indented
# JSON in the first user turn (or the system turn with tools_in_user_message=false), one call per assistant turn as
# {"name", "parameters"} JSON, tool results in an ipython turn (strings JSON-quoted: a string is iterable).
LLAMA31 = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and not tools is none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
            {%- endfor %}
            {{- ")" }}
        {%- else %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# Families whose templates have no tools (each reads only role and content).
QWEN2 = """{%- for message in messages %}
    {%- if loop.first and message.role != 'system' %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
MISTRAL = """{{ bos_token }}
{%- for message in messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if message['role'] == 'user' %}
{{ '[INST] ' + message['content'] + ' [/INST]' -}}
    {% elif message['role'] == 'assistant' %}
{{ message['content'] + eos_token -}}
    {% endif %}
{% endfor %}
"""
GEMMA = """{{ bos_token }}
{%- for message in messages -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\\n' + message['content'] | trim }}
    {{- '<end_of_turn>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\\n' }}
{%- endif -%}
"""

# family -> (tiny tokenizer style, template)
WITH_TOOLS = {"qwen2.5": ("qwen2", QWEN25), "qwen3": ("qwen2", QWEN3), "llama3.1": ("llama3", LLAMA31)}
WITHOUT_TOOLS = {"qwen2": ("qwen2", QWEN2), "llama3": ("llama3", LLAMA3), "mistral": ("llama2", MISTRAL),
                 "gemma": ("llama2", GEMMA)}
# The SentencePiece-style tiny tokenizer knows only the characters it was trained on.
CORPUS = ["[INST] [/INST] <start_of_turn>user\nmodel <end_of_turn>\n What is the weather in Paris? It is 18 C. "
          "thanks be brief"]


# ---------------------------------------------------------------- tools and conversations


class Unit(enum.Enum):
    CELSIUS = "celsius"
    FAHRENHEIT = "fahrenheit"


def get_weather(city: str, unit: Unit = Unit.CELSIUS, days: Optional[int] = None) -> dict[str, float]:
    """Get the weather forecast for a city.

    Args:
        city: The city to look up, e.g.
            "Paris" or "Tokyo".
        unit: The temperature unit.
        days (int): How many days ahead (1 to 7).

    Returns:
        The temperature by day.
    """
    return {}


def multiply(x: float, y: float) -> float:
    """
    Multiply two numbers.

    Args:
        x: The first number
        y: The second number (choices: [1, 2.5, 3])
    """
    return x * y


def search(query: str, tags: list[str], limit: Union[int, str] = 10, mode: Literal["fast", "deep"] = "fast",
           filters: dict[str, Any] | None = None, point: tuple[float, float] = (0.0, 0.0),
           either: Union[list[int], dict[str, int], None] = None, flag: bool = False, anything: Any = None):
    """Search the corpus.

    Args:
        query: What to search for.
        tags: Tags the results carry.
        limit: At most this many results.
        mode: How hard to look (choices: ["fast", "deep"])
        filters: Field filters.
        point: A location.
        either: Ids or counts.
        flag: A switch.
        anything: Whatever.

    Raises:
        ValueError: never.
    """


def annotated(x: int, y: str = "q", *rest: float, **options: bool) -> list[int]:
    """First line.
    Second line of the summary.

    Args:
        x (int): The x: with a colon.
            Continues here,
            and here.

        y (str, optional): Why (choices: ["p", "q"])
        rest: More numbers.
        options: Switches.

    Returns:
        list[int]: stuff
            more stuff

    Raises:
        ValueError: if bad
    """
    return []


class Custom:
    """A class with no JSON form."""


class Calculator:
    def add(self, a: int, b: int = 0) -> "Calculator":
        """Add two integers.

        Args:
            a: The first.
            b: The second.
        """
        return self


WEATHER_SCHEMA = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather forecast for a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city."},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "The unit."}},
        "required": ["city"]}}}

CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}
CALL2 = {"type": "function", "function": {"name": "multiply", "arguments": {"x": 2, "y": 2.5}}}
ASK = {"role": "user", "content": "What is the weather in Paris?"}
TOOL_TURNS = [ASK, {"role": "assistant", "content": None, "tool_calls": [CALL]},
              {"role": "tool", "content": "18 C", "name": "get_weather"},
              {"role": "assistant", "content": "It is 18 C."}]


def _conversations(family: str) -> list[tuple[list[dict], dict]]:
    """(messages, render kwargs) pairs that exercise a family's tool support."""
    system = {"role": "system", "content": "be brief"}
    out = [
        ([ASK], {"tools": [WEATHER_SCHEMA]}),
        ([system, ASK], {"tools": [get_weather, multiply, search, Calculator().add]}),
        (TOOL_TURNS, {"tools": [WEATHER_SCHEMA]}),
        (TOOL_TURNS[:3], {"tools": [WEATHER_SCHEMA]}),
        ([system, *TOOL_TURNS], {"tools": [get_weather]}),
        (TOOL_TURNS, {}),  # a history with calls, rendered without tool definitions
        ([ASK, {"role": "tool", "content": {"temperature": 18}}], {"tools": []}),
    ]
    if family != "llama3.1":  # Llama 3.1 takes one call per message (and says so, see below)
        out.append(([ASK, {"role": "assistant", "content": "Let me check.", "tool_calls": [CALL, CALL2]},
                     {"role": "tool", "content": "18 C"}, {"role": "tool", "content": "5.0"}],
                    {"tools": [get_weather, multiply]}))
    if family == "qwen3":
        out += [
            ([ASK, {"role": "assistant", "content": "", "reasoning_content": "\nI should look it up.\n",
                    "tool_calls": [CALL]}, {"role": "tool", "content": "18 C"}], {"tools": [WEATHER_SCHEMA]}),
            ([ASK, {"role": "assistant", "content": "", "thinking": "the old name", "tool_calls": [CALL]},
              {"role": "tool", "content": "18 C"}, {"role": "assistant", "content": "18 C.", "reasoning": "done"}],
             {"tools": [WEATHER_SCHEMA]}),
            ([ASK, {"role": "assistant", "content": "<think>\nhm\n</think>\n\nIt is 18 C."}, ASK],
             {"enable_thinking": False}),
            ([ASK, {"role": "assistant", "content": None, "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}],
             {"tools": [WEATHER_SCHEMA], "enable_thinking": True}),
        ]
    if family == "llama3.1":
        out += [
            ([ASK], {"tools": [get_weather], "tools_in_user_message": False, "date_string": "27 Nov 2026"}),
            ([ASK, {"role": "assistant", "tool_calls": [
                {"type": "function", "function": {"name": "brave_search", "arguments": {"query": "Paris"}}}]},
              {"role": "ipython", "content": "sunny"}], {"builtin_tools": ["brave_search", "code_interpreter"]}),
        ]
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny tokenizer folder per template family, with the template in tokenizer_config.json."""
    out = {}
    for family, (style, template) in {**WITH_TOOLS, **WITHOUT_TOOLS}.items():
        folder = save_tiny_tokenizer(tmp_path_factory.mktemp(family.replace(".", "_")), style, corpus=CORPUS)
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["chat_template"] = template
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        out[family] = folder
    return out


def _same_outcome(hf, ours, messages, **kwargs) -> bool:
    """Whatever transformers does with these messages we do: the same text, or an error where it raises one
    (returns whether it raised)."""
    try:
        expected = hf.apply_chat_template(messages, tokenize=False, **kwargs)
    except Exception:  # noqa: BLE001 - a template error, whatever transformers wraps it in
        with pytest.raises(ChatTemplateError):
            ours.render(messages, **kwargs)
        return True
    assert ours.render(messages, **kwargs) == expected, (messages, kwargs)
    return False


# ---------------------------------------------------------------- rendering parity


@pytest.mark.parametrize("family", sorted(WITH_TOOLS))
def test_tool_conversations_render_like_transformers(folders, family):
    hf = transformers.AutoTokenizer.from_pretrained(str(folders[family]))
    ours, tok = ChatTemplate.from_folder(folders[family]), load_tokenizer(folders[family])
    assert detect_tool_format(ours.source) == ("hermes" if family == "qwen2.5" else family)
    for messages, kwargs in _conversations(family):
        for gen in (False, True):
            expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen, **kwargs)
            text = ours.render(messages, add_generation_prompt=gen, **kwargs)
            assert text == expected, (family, messages, kwargs, gen)
            ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen, **kwargs)["input_ids"]
            assert tok.encode(text) == list(ids)
    # the tools are in the prompt, the call and the result in the conversation
    text = ours.render(TOOL_TURNS, tools=[get_weather])
    assert '"name": "get_weather"' in text and "18 C" in text and "The city to look up" in text
    if family == "llama3.1":  # one call per message: both refuse two
        two = [ASK, {"role": "assistant", "tool_calls": [CALL, CALL2]}]
        assert _same_outcome(hf, ours, two, tools=[WEATHER_SCHEMA])
        with pytest.raises(ChatTemplateError, match="single tool-calls"):
            ours.render(two, tools=[WEATHER_SCHEMA])


def test_qwen3_reasoning_and_enable_thinking(folders):
    ours = ChatTemplate.from_folder(folders["qwen3"])
    turns = [ASK, {"role": "assistant", "content": "", "reasoning_content": "look it up", "tool_calls": [CALL]},
             {"role": "tool", "content": "18 C"}]
    assert "<think>\nlook it up\n</think>" in ours.render(turns)  # after the last query: kept
    assert "look it up" not in ours.render([*turns, {"role": "assistant", "content": "18 C"}, ASK])
    assert ours.render([ASK], add_generation_prompt=True, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize("family", sorted(WITHOUT_TOOLS))
def test_families_without_tools_render_like_transformers(folders, family):
    """Their templates read no `tools`: transformers renders the conversation as without them, and so do we."""
    hf = transformers.AutoTokenizer.from_pretrained(str(folders[family]))
    ours = ChatTemplate.from_folder(folders[family])
    assert detect_tool_format(ours.source) is None
    messages = [ASK, {"role": "assistant", "content": "It is 18 C."}, {"role": "user", "content": "thanks"}]
    for gen in (False, True):
        expected = hf.apply_chat_template(messages, tools=[get_weather, WEATHER_SCHEMA], tokenize=False,
                                          add_generation_prompt=gen)
        assert ours.render(messages, tools=[get_weather, WEATHER_SCHEMA], add_generation_prompt=gen) == expected
        assert expected == ours.render(messages, add_generation_prompt=gen)
    # a tool-call message without content, a tool result: whatever the template makes of them (Qwen2 and Mistral
    # fail on the missing content or the role, Llama 3 and Gemma render what they read), transformers and we agree
    for calls in ([ASK, {"role": "assistant", "content": None, "tool_calls": [CALL]}],
                  [ASK, {"role": "assistant", "content": "", "tool_calls": [CALL]}, {"role": "tool", "content": "18"}]):
        raised = _same_outcome(hf, ours, calls, tools=[WEATHER_SCHEMA])
        assert raised == (family in ("qwen2", "mistral") and calls[1]["content"] is None or
                          family == "mistral" and len(calls) == 3), (family, calls)


def _folder_with(tmp_path, config_templates=None, files=None):
    folder = save_tiny_tokenizer(tmp_path / "tok", "qwen2")
    if config_templates is not None:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["chat_template"] = config_templates
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    for path, text in (files or {}).items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_text(text)
    return folder


@pytest.mark.parametrize("layout", ["config_list", "files"])
def test_tool_use_template_is_picked_when_tools_are_given(tmp_path, layout):
    """A checkpoint naming several templates: "tool_use" when tools are given (an empty list too), else
    "default", as transformers picks; from tokenizer_config.json's list or additional_chat_templates/."""
    if layout == "config_list":
        folder = _folder_with(tmp_path, [{"name": "default", "template": QWEN2},
                                         {"name": "tool_use", "template": QWEN25}])
    else:
        folder = _folder_with(tmp_path, "ignored: files win {{ x", {
            "chat_template.jinja": QWEN2, "additional_chat_templates/tool_use.jinja": QWEN25})
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    ours = ChatTemplate.from_folder(folder)
    assert ours.select(None) == "default" and ours.select([]) == "tool_use"
    assert detect_tool_format(ours.source) is None and detect_tool_format(ours.tool_source) == "hermes"
    for tools in (None, [], [get_weather]):
        for messages in ([ASK], TOOL_TURNS[:3]):  # the default one fails on the call's missing content
            assert _same_outcome(hf, ours, messages, tools=tools) == (tools is None and len(messages) == 3)
    assert "# Tools" in ours.render([ASK], tools=[get_weather]) and "# Tools" not in ours.render([ASK])


def test_several_templates_without_default(tmp_path):
    folder = _folder_with(tmp_path, [{"name": "tool_use", "template": QWEN25}, {"name": "rag", "template": QWEN2}])
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    ours = ChatTemplate.from_folder(folder)
    assert ours.render([ASK], tools=[WEATHER_SCHEMA]) == hf.apply_chat_template([ASK], tools=[WEATHER_SCHEMA],
                                                                                tokenize=False)
    with pytest.raises(ValueError):
        hf.apply_chat_template([ASK], tokenize=False)
    with pytest.raises(ChatTemplateError, match="no default"):
        ours.render([ASK])


def test_documents_extra_variables_and_template_data(tmp_path):
    """`documents` and extra kwargs reach the template (kwargs over the special tokens of the same name), and
    values are rebuilt as transformers rebuilds them (enums and other str subclasses as str, tuples kept, other
    objects as a placeholder)."""
    template = ("{{ eos_token }}|{% for d in documents %}{{ d.title }}:{{ d.text }};{% endfor %}|{{ extra }}|"
                "{{ messages[0].content }}|{{ messages[0].meta }}|{{ tools | tojson }}")
    folder = _folder_with(tmp_path, files={"chat_template.jinja": template})
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    ours = ChatTemplate.from_folder(folder)
    messages = [{"role": "user", "content": Unit.CELSIUS.value,
                 "meta": (1, object(), Unit.CELSIUS, np.int64(3), np.bool_(False), np.zeros(2), np.array(1.5))}]
    kwargs = dict(documents=[{"title": "a", "text": "b"}], extra=("x", 1), eos_token="<eos>", tools=[multiply])
    assert ours.render(messages, **kwargs) == hf.apply_chat_template(messages, tokenize=False, **kwargs)


# ---------------------------------------------------------------- function -> schema


def test_function_schemas_equal_transformers():
    for func in (get_weather, multiply, search, annotated, Calculator().add, Calculator.add):
        ours, theirs = function_schema(func), get_json_schema(func)
        assert ours == theirs, func
        assert json.dumps(ours) == json.dumps(theirs)  # same key order: templates write them with tojson
    params = tool_parameters([get_weather, WEATHER_SCHEMA])
    assert params["get_weather"]["required"] == ["city"]


def test_functions_that_cannot_be_described_raise_one_clear_error():
    def no_doc(x: int):
        return x

    def no_hint(x):
        """Do it.

        Args:
            x: A thing.
        """

    def undescribed(x: int, y: int):
        """Do it.

        Args:
            x: A thing.
        """

    def custom(x: Custom):
        """Do it.

        Args:
            x: A thing.
        """

    cases = [(no_doc, "no docstring"), (no_hint, "'x' has no type hint"),
             (undescribed, "does not describe argument 'y'"),
             (custom, "argument 'x'.*no JSON form")]
    for func, message in cases:
        with pytest.raises(Exception):
            get_json_schema(func)
        with pytest.raises(ToolSchemaError, match=f"cannot describe tool {func.__name__}: .*{message}"):
            function_schema(func)
    with pytest.raises(ToolSchemaError, match="JSON-schema dict or a function"):
        ChatTemplate(QWEN25, {}).render([ASK], tools=[len])


# ---------------------------------------------------------------- parsing


TOOLS = [get_weather, multiply, search]


def test_hermes_calls_are_parsed():
    text = ('Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
            '</tool_call>\n<tool_call>\n{"name": "multiply", "arguments": {"x": 2, "y": 2.5}}\n</tool_call>')
    for family in ("qwen2.5", "qwen3", "hermes"):
        parsed = parse_tool_calls(text, family, TOOLS)
        assert isinstance(parsed, ParsedToolCalls) and parsed.ok
        assert parsed.content == "Let me check both."
        assert parsed.calls == (ToolCall("get_weather", {"city": "Paris", "days": 2}),
                                ToolCall("multiply", {"x": 2, "y": 2.5}))
    assert parse_tool_calls("It is 18 C.", "qwen2.5", TOOLS) == ParsedToolCalls("It is 18 C.")
    # without tools only the syntax is checked
    assert parse_tool_calls('<tool_call>{"name": "anything", "arguments": {}}</tool_call>', "qwen2.5").calls == (
        ToolCall("anything", {}),)


def test_qwen3_reasoning_is_split_off_and_calls_in_it_are_not_calls():
    text = ('<think>\nMaybe <tool_call>{"name": "nope"}</tool_call>? No, get_weather.\n</think>\n\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    parsed = parse_tool_calls(text, "qwen3", TOOLS)
    assert parsed.ok and parsed.content == "" and parsed.calls == (ToolCall("get_weather", {"city": "Paris"}),)
    assert parsed.reasoning.startswith("Maybe <tool_call>")
    # the generation prompt opened the think block: the text has only its end
    parsed = parse_tool_calls("plan\n</think>\n\nIt is 18 C.", "qwen3", TOOLS)
    assert (parsed.reasoning, parsed.content, parsed.calls) == ("plan", "It is 18 C.", ())


def test_parsed_calls_render_back_to_the_models_text(folders):
    """The parsed message, appended to the conversation, renders as the model wrote it (Qwen2.5, Qwen3 and
    Llama 3.1): the next turn's prompt extends this one's."""
    cases = {
        "qwen2.5": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
        "qwen3": ('<think>\ncheck\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
                  '\n</tool_call>'),
        "llama3.1": '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}',
    }
    for family, generated in cases.items():
        ours = ChatTemplate.from_folder(folders[family])
        prompt = ours.render([ASK], tools=[get_weather], add_generation_prompt=True)
        parsed = parse_tool_calls(generated, family, [get_weather])
        assert parsed.ok, parsed
        full = ours.render([ASK, parsed.assistant_message()], tools=[get_weather])
        assert full.startswith(prompt + generated), (family, full)


def test_llama31_json_calls_are_parsed():
    parsed = parse_tool_calls('{"name": "get_weather", "parameters": {"city": "Paris"}}', "llama3.1", TOOLS)
    assert parsed.ok and parsed.calls == (ToolCall("get_weather", {"city": "Paris"}),) and parsed.content == ""
    tagged = '<|python_tag|>{"name": "multiply", "arguments": {"x": 1, "y": 3}}; {"name": "get_weather", ' \
             '"parameters": {"city": "a;b"}}'
    assert parse_tool_calls(tagged, "llama3.2", TOOLS).calls == (ToolCall("multiply", {"x": 1, "y": 3}),
                                                                   ToolCall("get_weather", {"city": "a;b"}))
    assert parse_tool_calls("  It is 18 C.\n", "llama3.1", TOOLS) == ParsedToolCalls("It is 18 C.")
    # a built-in tool's call, written back by the template as the model wrote it
    builtin = '<|python_tag|>brave_search.call(query="Paris", count=3)'
    parsed = parse_tool_calls(builtin, "llama3.1")
    assert parsed.calls == (ToolCall("brave_search", {"query": "Paris", "count": 3}),)
    ours = ChatTemplate(LLAMA31, {"bos_token": "<|begin_of_text|>"})
    parsed = parse_tool_calls('<|python_tag|>brave_search.call(query="Paris")', "llama3.1")
    assert ours.render([ASK, parsed.assistant_message()], builtin_tools=["brave_search"]).endswith(
        '<|python_tag|>brave_search.call(query="Paris")<|eom_id|>')


# (family, text, [(kind, call index or None, message part)])
MALFORMED = [
    ("qwen2.5", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',
     [("bad_json", 0, "not valid JSON")]),
    ("qwen2.5", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}',
     [("malformed", 0, "never closed")]),
    ("qwen2.5", 'done</tool_call>', [("malformed", None, "without an opening")]),
    ("qwen2.5", '<tool_call><tool_call>{"name": "multiply", "arguments": {"x": 1, "y": 1}}</tool_call>',
     [("malformed", 0, "opened again")]),
    ("qwen2.5", '<tool_call>["get_weather"]</tool_call>', [("malformed", 0, "expected a JSON object")]),
    ("qwen2.5", '<tool_call>{"arguments": {}}</tool_call>', [("malformed", 0, 'no "name"')]),
    ("qwen2.5", '<tool_call>{"name": "multiply"}</tool_call>', [("malformed", 0, 'no "arguments"')]),
    ("qwen2.5", '<tool_call>{"name": "multiply", "arguments": "x=1"}</tool_call>',
     [("malformed", 0, "must be a JSON object, got string")]),
    ("qwen2.5", '<tool_call>{"name": "get_wether", "arguments": {"city": "Paris"}}</tool_call>',
     [("unknown_tool", 0, "unknown tool 'get_wether' (available: get_weather, multiply, search)")]),
    ("qwen2.5", '<tool_call>{"name": "get_weather", "arguments": {"days": 2}}</tool_call>',
     [("bad_arguments", 0, "get_weather: arguments: missing required argument 'city'")]),
    ("qwen2.5", '<tool_call>{"name": "get_weather", "arguments": {"city": 7, "unit": "kelvin", "days": true}}'
                '</tool_call>',
     [("bad_arguments", 0, "argument 'city' must be string, got integer 7"),
      ("bad_arguments", 0, "argument 'unit' must be one of"),
      ("bad_arguments", 0, "argument 'days' must be integer, got boolean true")]),
    ("qwen2.5", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "country": "FR"}}</tool_call>',
     [("bad_arguments", 0, "unexpected argument 'country'")]),
    ("qwen2.5", '<tool_call>{"name": "search", "arguments": {"query": "q", "tags": ["a", 1], "point": [1, "x"], '
                '"filters": 3}}</tool_call>',
     [("bad_arguments", 0, "argument 'tags'[1] must be string"),
      ("bad_arguments", 0, "argument 'point'[1] must be number"),
      ("bad_arguments", 0, "argument 'filters' must be object")]),
    ("qwen2.5", '<tool_call>{"name": "multiply", "arguments": {"x": 1, "y": 7}}</tool_call>\n'
                '<tool_call>{"name": "multiply", "arguments": {"x": "1", "y": 1}}</tool_call>',
     [("bad_arguments", 0, "argument 'y' must be one of [1, 2.5, 3], got 7"),
      ("bad_arguments", 1, "argument 'x' must be number, got string")]),
    ("qwen3", '<think>\nok\n</think>\n\n<tool_call>{"name": "get_weather", "arguments": {}</tool_call>',
     [("bad_json", 0, "not valid JSON")]),
    ("llama3.1", '{"name": "get_weather", "parameters": {"city": "Paris"}', [("bad_json", 0, "not valid JSON")]),
    ("llama3.1", '<|python_tag|>print(1 + 1)', [("malformed", 0, "after <|python_tag|> write a JSON call")]),
    ("llama3.1", '<|python_tag|>brave_search.call("Paris")', [("malformed", 0, "keyword arguments with literal")]),
    ("llama3.1", '<|python_tag|>brave_search.call(query=x)', [("malformed", 0, "keyword arguments with literal")]),
    ("llama3.1", '<|python_tag|>brave_search.call(query="Paris")',
     [("unknown_tool", 0, "unknown tool 'brave_search'")]),
    ("llama3.1", '<|python_tag|>', [("malformed", 0, "after <|python_tag|> write a JSON call")]),
    ("llama3.1", '{"answer": 18}', [("malformed", 0, 'no "name"')]),
    ("llama3.1", '{"name": "get_weather"}', [("malformed", 0, 'no "parameters"')]),
    ("llama3.1", '{"name": "weather", "parameters": {}}; {"name": "multiply", "parameters": {"x": 1}}',
     [("unknown_tool", 0, "unknown tool 'weather'"),
      ("bad_arguments", 1, "missing required argument 'y'")]),
]


@pytest.mark.parametrize("family, text, problems", MALFORMED)
def test_malformed_calls_come_back_as_errors(family, text, problems):
    result = parse_tool_calls(text, family, TOOLS)  # never raises
    assert isinstance(result, ToolCallError) and not result.ok, result
    assert len(result.problems) == len(problems), result.problems
    for problem, (kind, call, part) in zip(result.problems, problems):
        assert (problem.kind, problem.call) == (kind, call) and part in problem.message, problem
    assert result.kind == problems[0][0]
    observation = result.observation
    assert observation.startswith("Error: ") and all(p[2] in observation for p in problems)
    if len(problems) > 1:
        assert observation.count("\n- ") == len(problems)


def test_error_observations_and_registry():
    result = parse_tool_calls('<tool_call>{"name": "multiply", "arguments": {"x": 1}}</tool_call> thinking aloud',
                              "qwen2.5", TOOLS)
    assert result.content == "thinking aloud"
    assert result.observation == "Error: tool call 1: multiply: arguments: missing required argument 'y'"
    nullable = parse_tool_calls('<tool_call>{"name": "search", "arguments": {"query": "q", "tags": [], '
                                '"either": null, "limit": "all", "anything": [1]}}</tool_call>', "qwen2.5", TOOLS)
    assert nullable.ok, nullable
    assert set(TOOL_CALL_FORMATS) >= {"hermes", "qwen2.5", "qwen3", "llama3.1"}
    for family in ("qwen2", "llama3", "mistral", "gemma"):
        assert family not in TOOL_CALL_FORMATS
    with pytest.raises(ValueError, match="unknown tool-call format 'qwen'.*Known"):
        parse_tool_calls("x", "qwen")
