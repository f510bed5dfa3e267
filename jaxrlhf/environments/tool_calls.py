"""Tool calls parsed out of a model's text, in its chat template family's format (no JAX).

`parse_tool_calls(text, family, tools)` reads an assistant message in the format of a
template family (`TOOL_CALL_FORMATS`, a registry by family name):

- Hermes style (Qwen2.5, Qwen3, Hermes 2/3, QwQ): any number of
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks; the content is the text
  outside them. Qwen3's `<think>...</think>` reasoning is split off first (a call written while
  thinking is not a call).
- Llama 3.1 JSON style (Llama 3.1 / 3.2 / 3.3): the whole message is `{"name": ..., "parameters":
  {...}}` (also `"arguments"`), optionally after `<|python_tag|>`, several separated by `;`, or after
  the tag a built-in tool's `brave_search.call(query="...")`; a message that does not start with `{`
  (or the tag) is plain content.

The result is a value, never an exception: `ParsedToolCalls` (content, calls, reasoning), or
`ToolCallError` listing every problem (bad JSON, a malformed call, an unknown tool, arguments that do
not match the tool's schema: a missing required key, an unexpected key, a wrong type, a value outside
an enum). Its `observation` is the text an environment shows the model as the tool's answer. The tools'
schemas come from `models.tool_schema` (what the chat template renders).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Callable, Mapping, Sequence

from jaxrlhf.models.tool_schema import ToolSchemaError, function_schema, tool_parameters, tool_schema
from jaxrlhf.registry import Registry

__all__ = ["TOOL_CALL_FORMATS", "ParsedToolCalls", "ToolCall", "ToolCallError", "ToolCallProblem", "ToolSchemaError",
           "detect_tool_format", "function_schema", "parse_tool_calls", "tool_parameters", "tool_schema"]


# ---------------------------------------------------------------- parsed calls and errors


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call the model wrote: a tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]

    def message_entry(self) -> dict[str, Any]:
        """The call as an assistant message's `tool_calls` entry, the form transformers' templates read."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


PROBLEM_KINDS = ("bad_json", "malformed", "unknown_tool", "bad_arguments")


@dataclasses.dataclass(frozen=True)
class ToolCallProblem:
    """What is wrong with one call (`call`: its 0-based position in the message) or the message (None)."""

    kind: str  # one of PROBLEM_KINDS
    message: str
    call: int | None = None


@dataclasses.dataclass(frozen=True)
class ParsedToolCalls:
    """A well-formed assistant message: its text outside the calls, the calls, and (Qwen3) its reasoning."""

    content: str
    calls: tuple[ToolCall, ...] = ()
    reasoning: str | None = None
    ok: bool = dataclasses.field(default=True, init=False)

    def assistant_message(self) -> dict[str, Any]:
        """The message to append to the conversation (`tool_calls`, `reasoning_content` as templates read them)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning
        if self.calls:
            message["tool_calls"] = [c.message_entry() for c in self.calls]
        return message


@dataclasses.dataclass(frozen=True)
class ToolCallError:
    """A message whose calls cannot be run: every problem found, and the text outside the calls."""

    problems: tuple[ToolCallProblem, ...]
    content: str = ""
    reasoning: str | None = None
    ok: bool = dataclasses.field(default=False, init=False)

    @property
    def kind(self) -> str:
        return self.problems[0].kind

    @property
    def observation(self) -> str:
        """What the environment shows the model in place of the tools' results."""
        lines = [p.message if p.call is None else f"tool call {p.call + 1}: {p.message}" for p in self.problems]
        return "Error: " + ("\n".join(lines) if len(lines) == 1 else "\n" + "\n".join(f"- {line}" for line in lines))


# ---------------------------------------------------------------- arguments against a JSON schema

_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer()),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}


def _json_type(value: Any) -> str:
    for name in ("null", "boolean", "integer", "number", "string", "array", "object"):
        if _JSON_TYPES[name](value):
            return name
    return type(value).__name__


def _same(a: Any, b: Any) -> bool:
    """JSON equality (True is not 1)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    return a == b


def _show(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


def schema_problems(value: Any, schema: Mapping[str, Any], where: str = "arguments") -> list[str]:
    """Where `value` does not match `schema`: the JSON-schema keywords tool schemas use (type, enum, const,
    required, properties, additionalProperties, items, prefixItems, anyOf/oneOf, and transformers'
    `nullable`); other keywords are not checked."""
    if not isinstance(schema, Mapping):
        return []
    if value is None and schema.get("nullable") is True:
        return []
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list) and options and all(schema_problems(value, o, where) for o in options):
            return [f"{where} must match one of {len(options)} schemas, got {_show(value)}"]
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds if isinstance(kinds, list) else None
    if kinds is not None:
        known = [k for k in kinds if k in _JSON_TYPES]
        if known and not any(_JSON_TYPES[k](value) for k in known):
            return [f"{where} must be {' or '.join(known)}, got {_json_type(value)} {_show(value)}"]
    if isinstance(schema.get("enum"), list) and not any(_same(value, e) for e in schema["enum"]):
        return [f"{where} must be one of {_show(schema['enum'])}, got {_show(value)}"]
    if "const" in schema and not _same(value, schema["const"]):
        return [f"{where} must be {_show(schema['const'])}, got {_show(value)}"]
    problems: list[str] = []
    if isinstance(value, dict):
        properties = schema.get("properties") if isinstance(schema.get("properties"), Mapping) else {}
        for key in schema.get("required") or ():
            if key not in value:
                problems.append(f"{where}: missing required argument {key!r}" if where == "arguments"
                                else f"{where}: missing required key {key!r}")
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            inner = f"argument {key!r}" if where == "arguments" else f"{where}.{key}"
            if key in properties:
                problems += schema_problems(item, properties[key], inner)
            elif extra is False:
                problems.append(f"{where}: unexpected argument {key!r}" if where == "arguments"
                                else f"{where}: unexpected key {key!r}")
            elif isinstance(extra, Mapping):
                problems += schema_problems(item, extra, inner)
    if isinstance(value, list):
        prefix = schema.get("prefixItems") if isinstance(schema.get("prefixItems"), list) else []
        for i, item in enumerate(value):
            if i < len(prefix):
                problems += schema_problems(item, prefix[i], f"{where}[{i}]")
            elif isinstance(schema.get("items"), Mapping):
                problems += schema_problems(item, schema["items"], f"{where}[{i}]")
    return problems


def argument_problems(arguments: dict[str, Any], parameters: Mapping[str, Any]) -> list[str]:
    """Where a call's arguments do not match its tool's parameters schema. An argument the schema does not
    list is a problem too (the tool is called with the arguments as keywords) unless the schema allows
    more (`additionalProperties`)."""
    schema = dict(parameters)
    if "additionalProperties" not in schema and isinstance(schema.get("properties"), Mapping):
        schema["additionalProperties"] = False
    return schema_problems(arguments, schema)


# ---------------------------------------------------------------- parsers


def _check_calls(raw: list[tuple[int, Any]], tools: Mapping[str, dict] | None, arguments_keys: tuple[str, ...],
                 problems: list[ToolCallProblem]) -> list[ToolCall]:
    """Turn decoded JSON objects into calls; what is wrong goes into `problems`."""
    calls = []
    for index, obj in raw:
        if not isinstance(obj, dict):
            problems.append(ToolCallProblem("malformed", f"expected a JSON object with \"name\" and "
                                            f"\"{arguments_keys[0]}\", got {_json_type(obj)} {_show(obj)}", index))
            continue
        name = obj.get("name")
        if not isinstance(name, str) or not name:
            problems.append(ToolCallProblem("malformed", "the call has no \"name\" (a string)", index))
            continue
        key = next((k for k in arguments_keys if k in obj), None)
        if key is None:
            problems.append(ToolCallProblem("malformed", f"the call of {name!r} has no \"{arguments_keys[0]}\" "
                                            "(a JSON object, {} for none)", index))
            continue
        arguments = obj[key]
        if not isinstance(arguments, dict):
            problems.append(ToolCallProblem("malformed", f"the \"{key}\" of {name!r} must be a JSON object, got "
                                            f"{_json_type(arguments)} {_show(arguments)}", index))
            continue
        if tools is not None:
            if name not in tools:
                known = ", ".join(sorted(tools)) or "none"
                problems.append(ToolCallProblem("unknown_tool", f"unknown tool {name!r} (available: {known})", index))
                continue
            wrong = argument_problems(arguments, tools[name])
            if wrong:
                problems += [ToolCallProblem("bad_arguments", f"{name}: {w}", index) for w in wrong]
                continue
        calls.append(ToolCall(name, arguments))
    return calls


def _result(content: str, calls: list[ToolCall], problems: list[ToolCallProblem],
            reasoning: str | None) -> "ParsedToolCalls | ToolCallError":
    if problems:
        return ToolCallError(tuple(problems), content, reasoning)
    return ParsedToolCalls(content, tuple(calls), reasoning)


def _decode(text: str, index: int, problems: list[ToolCallProblem]) -> tuple[bool, Any]:
    try:
        return True, json.loads(text)
    except json.JSONDecodeError as e:
        problems.append(ToolCallProblem("bad_json", f"not valid JSON ({e.msg} at line {e.lineno} column "
                                        f"{e.colno}): {_show(text) if len(text) < 200 else _show(text[:200])}", index))
        return False, None


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, the rest) of a thinking model's text: what precedes `</think>` (its `<think>` dropped,
    whichever side the generation prompt put it), or (None, text) without one."""
    if "</think>" not in text:
        return None, text
    reasoning, rest = text.split("</think>", 1)
    reasoning = reasoning.split("<think>", 1)[-1]
    return reasoning.strip("\n"), rest.lstrip("\n")


_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"


def parse_hermes(text: str, tools: Sequence[Any] | Mapping[str, dict] | None = None, *,
                 thinking: bool = False) -> "ParsedToolCalls | ToolCallError":
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks anywhere in the message (Qwen2.5, Qwen3,
    Hermes); the content is the text outside them, stripped. `thinking`: split `<think>` reasoning off first."""
    table = _tool_table(tools)
    reasoning = None
    if thinking:
        reasoning, text = split_reasoning(text)
    problems: list[ToolCallProblem] = []
    outside, raw = [], []
    rest, index = text, 0
    while True:
        start = rest.find(_HERMES_OPEN)
        stray = rest.find(_HERMES_CLOSE)
        if stray != -1 and (start == -1 or stray < start):
            problems.append(ToolCallProblem("malformed", f"{_HERMES_CLOSE} without an opening {_HERMES_OPEN}"))
            outside.append(rest[:stray])
            rest = rest[stray + len(_HERMES_CLOSE):]
            continue
        if start == -1:
            outside.append(rest)
            break
        outside.append(rest[:start])
        body_start = start + len(_HERMES_OPEN)
        end = rest.find(_HERMES_CLOSE, body_start)
        if end == -1:
            problems.append(ToolCallProblem("malformed", f"{_HERMES_OPEN} is never closed with {_HERMES_CLOSE}",
                                            index))
            break
        body = rest[body_start:end].strip()
        if _HERMES_OPEN in body:
            problems.append(ToolCallProblem("malformed", f"{_HERMES_OPEN} opened again before {_HERMES_CLOSE}",
                                            index))
        else:
            good, obj = _decode(body, index, problems)
            if good:
                raw.append((index, obj))
        index += 1
        rest = rest[end + len(_HERMES_CLOSE):]
    calls = _check_calls(raw, table, ("arguments",), problems)
    return _result("".join(outside).strip(), calls, problems, reasoning)


_PYTHON_TAG = "<|python_tag|>"


def _split_json_objects(text: str) -> list[str]:
    """`{...}; {...}` split at the `;`s outside brackets and strings (the pieces stripped, empty ones dropped)."""
    parts, depth, in_string, escape, start = [], 0, False, False, 0
    for i, ch in enumerate(text):
        if in_string:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == ";" and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


_BUILTIN_CALL = re.compile(r"^([A-Za-z_]\w*)\.call\((.*)\)$", re.DOTALL)


def _builtin_call(text: str, problems: list[ToolCallProblem]) -> tuple[bool, Any]:
    """Llama 3.1's built-in tool call `brave_search.call(query="...")` as {"name", "parameters"} (keyword
    arguments with literal values only)."""
    import ast

    match = _BUILTIN_CALL.match(text)
    usage = ('after <|python_tag|> write a JSON call {"name": ..., "parameters": {...}} or a built-in tool call '
             'name.call(key="value", ...)')
    if match is None:
        problems.append(ToolCallProblem("malformed", f"{usage}, got {_show(text)}", 0))
        return False, None
    try:
        call = ast.parse(f"f({match.group(2)})", mode="eval").body
        if not isinstance(call, ast.Call) or call.args or any(k.arg is None for k in call.keywords):
            raise ValueError("only keyword arguments")
        arguments = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    except (SyntaxError, ValueError, TypeError) as e:
        problems.append(ToolCallProblem("malformed", f"{usage} (keyword arguments with literal values): {e}", 0))
        return False, None
    return True, {"name": match.group(1), "parameters": arguments}


def parse_llama3_json(text: str, tools: Sequence[Any] | Mapping[str, dict] | None = None
                      ) -> "ParsedToolCalls | ToolCallError":
    """Llama 3.1's JSON tool calls: the whole message is `{"name": ..., "parameters": {...}}` (or
    `"arguments"`), optionally after `<|python_tag|>`, several separated by `;`; after the tag also a built-in
    tool's `name.call(key="value", ...)`. A message that starts with neither `{` nor the tag is plain content;
    one that does is a call and must be one."""
    table = _tool_table(tools)
    stripped = text.strip()
    tagged = stripped.startswith(_PYTHON_TAG)
    if tagged:
        stripped = stripped[len(_PYTHON_TAG):].strip()
    elif not stripped.startswith("{"):
        return ParsedToolCalls(stripped)
    problems: list[ToolCallProblem] = []
    raw = []
    if tagged and not stripped.startswith("{"):  # a built-in tool: name.call(key="value", ...)
        good, obj = _builtin_call(stripped, problems)
        if good:
            raw.append((0, obj))
        return _result("", _check_calls(raw, table, ("parameters",), problems), problems, None)
    for index, part in enumerate(_split_json_objects(stripped) or [stripped]):
        good, obj = _decode(part, index, problems)
        if good:
            raw.append((index, obj))
    calls = _check_calls(raw, table, ("parameters", "arguments"), problems)
    return _result("", calls, problems, None)


def _tool_table(tools: Sequence[Any] | Mapping[str, dict] | None) -> dict[str, dict] | None:
    if tools is None:
        return None
    if isinstance(tools, Mapping):  # already name -> parameters
        return dict(tools)
    return tool_parameters(tools)


ToolCallParser = Callable[..., "ParsedToolCalls | ToolCallError"]


def _qwen3(text: str, tools: Any = None) -> "ParsedToolCalls | ToolCallError":
    return parse_hermes(text, tools, thinking=True)


def _hermes(text: str, tools: Any = None) -> "ParsedToolCalls | ToolCallError":
    return parse_hermes(text, tools)


# Template family -> how its models write tool calls. Families whose templates have no tools (Qwen2, Llama 3,
# Mistral v0.1/v0.2, Gemma 2/3) are not here.
TOOL_CALL_FORMATS: Registry[ToolCallParser] = Registry("tool-call format", entries={
    "hermes": _hermes,
    "qwen2.5": _hermes,
    "qwen3": _qwen3,
    "llama3.1": parse_llama3_json,
    "llama3.2": parse_llama3_json,
    "llama3.3": parse_llama3_json,
})


def parse_tool_calls(text: str, family: str, tools: Sequence[Any] | Mapping[str, dict] | None = None
                     ) -> "ParsedToolCalls | ToolCallError":
    """The calls in an assistant message written in `family`'s format (`TOOL_CALL_FORMATS`), checked against
    `tools` (schemas or functions, or name -> parameters schema; None: only the syntax is checked). An unknown
    family raises ValueError (a configuration mistake); everything wrong with the text is returned."""
    return TOOL_CALL_FORMATS.get(family)(text, tools)


def detect_tool_format(template_source: str | None) -> str | None:
    """The `TOOL_CALL_FORMATS` family a chat template's tool calls look like, or None when it renders none."""
    if not template_source or "tool" not in template_source:
        return None
    if "<tool_call>" in template_source:
        return "qwen3" if "reasoning_content" in template_source or "<think>" in template_source else "hermes"
    if "ipython" in template_source and "parameters" in template_source:
        return "llama3.1"
    return None
