"""Tool calling: tool definitions as JSON schemas, and tool calls parsed out of a model's text.

**Definitions.** A chat template describes its tools from JSON schemas
(`{"type": "function", "function": {"name", "description", "parameters"}}`). `tool_schema(tool)`
takes such a dict as is, or writes one for a Python function exactly as transformers'
`get_json_schema` does (its type hints and its Google-style docstring: a description, an `Args:`
block describing every argument, optionally `Returns:` and `(choices: [...])` at the end of an
argument's line), so a rendered prompt is byte-identical to `apply_chat_template(..., tools=[f])`.
A function it cannot describe (no docstring, an argument without a type hint or a description, a
type with no JSON form) raises `ToolSchemaError` naming the function and what is missing.

**Calls.** `parse_tool_calls(text, family, tools)` reads an assistant message in the format of a
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
an enum). Its `observation` is the text an environment shows the model as the tool's answer.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import json
import re
import types
from typing import Any, Callable, Literal, Mapping, Sequence, Union, get_args, get_origin, get_type_hints

from jaxrlhf.registry import Registry


class ToolSchemaError(ValueError):
    """A tool that cannot be described as a JSON schema (a function without the hints or docstring
    `tool_schema` needs), or a tool that is neither a schema dict nor a function."""


# ---------------------------------------------------------------- function -> JSON schema (as transformers)

_DESCRIPTION = re.compile(r"^(.*?)[\n\s]*(Args:|Returns:|Raises:|\Z)", re.DOTALL)
_ARGS = re.compile(r"\n\s*Args:\n(.*?)[\n\s]*(Returns:|Raises:|\Z)", re.DOTALL)
# One argument: its name at some indentation, an optional "(type)", a colon, then its description up to the next
# "name:" line not indented deeper than this one.
_ARG = re.compile(
    r"(?:^|\n)([ \t]*)(\w+)(?:[ \t]*\([^()\n]*\))?:\s*(.*?)\s*(?=\n(?!\1[ \t])[ \t]*\w+(?:[ \t]*\([^()\n]*\))?:|\Z)",
    re.DOTALL,
)
_RETURNS = re.compile(r"\n\s*Returns:\n\s*(.*?)[\n\s]*(Raises:|\Z)", re.DOTALL)
_CHOICES = re.compile(r"\(choices:\s*(.*?)\)\s*$", re.IGNORECASE)

_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}
_BARE = {int: {"type": "integer"}, float: {"type": "number"}, str: {"type": "string"}, bool: {"type": "boolean"},
         type(None): {"type": "null"}, list: {"type": "array"}, tuple: {"type": "array"}, dict: {"type": "object"}}


class _Unsupported(Exception):
    pass


def _enum_schema(values: list) -> dict:
    kinds = list(dict.fromkeys(_SCALARS[type(v)] for v in values))
    return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": values}


def _hint_schema(hint: Any) -> dict:
    """The JSON schema of one type hint, as transformers writes it (same keys, same order)."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is None and isinstance(hint, type) and issubclass(hint, enum.Enum):
        values = [member.value for member in hint]
        if not values:
            raise _Unsupported(f"the Enum {hint.__name__} has no members")
        if any(type(v) not in _SCALARS for v in values):
            raise _Unsupported(f"the Enum {hint.__name__} has values that are not JSON scalars: {values}")
        return _enum_schema(values)
    if origin is None:
        if hint is Any:
            return {}
        if isinstance(hint, type) and hint in _BARE:
            return dict(_BARE[hint])
        raise _Unsupported(f"the type {hint!r} has no JSON form (supported: int, float, str, bool, None, Any, "
                           "Enum, Literal, and list, tuple, dict and unions of those)")
    if origin is Union or origin is types.UnionType:
        subtypes = [_hint_schema(t) for t in args if t is not type(None)]
        if len(subtypes) == 1:
            out = subtypes[0]
        elif all(s.keys() == {"type"} and isinstance(s["type"], str) for s in subtypes):
            names = sorted({s["type"] for s in subtypes})
            out = {"type": names[0] if len(names) == 1 else names}
        else:
            out = {"anyOf": subtypes}
        if type(None) in args:
            out["nullable"] = True
        return out
    if origin is Literal and args:
        if any(type(a) not in _SCALARS for a in args):
            raise _Unsupported(f"the Literal {hint!r} holds values that are not JSON scalars")
        return _enum_schema(list(args))
    if origin is list:
        return {"type": "array", "items": _hint_schema(args[0])} if args else {"type": "array"}
    if origin is tuple:
        if not args:
            return {"type": "array"}
        if len(args) == 1:
            raise _Unsupported(f"the one-element tuple {hint!r} (use list[...] or the element's type)")
        if ... in args:
            raise _Unsupported(f"the variable-length tuple {hint!r} (use list[...])")
        return {"type": "array", "prefixItems": [_hint_schema(t) for t in args]}
    if origin is dict:
        out = {"type": "object"}
        if len(args) == 2:
            out["additionalProperties"] = _hint_schema(args[1])
        return out
    raise _Unsupported(f"the type {hint!r} has no JSON form")


def _docstring_parts(doc: str) -> tuple[str | None, dict[str, str], str | None]:
    description = _DESCRIPTION.search(doc)
    args_block = _ARGS.search(doc)
    returns = _RETURNS.search(doc)
    described: dict[str, str] = {}
    if args_block is not None:
        block = "\n".join(line for line in args_block.group(1).split("\n") if line.strip())
        described = {m[1]: re.sub(r"\s*\n+\s*", " ", m[2].strip()) for m in _ARG.findall(block)}
    return (description.group(1).strip() if description else None, described,
            returns.group(1).strip() if returns else None)


def function_schema(func: Callable) -> dict:
    """`{"type": "function", "function": {...}}` for a Python function or bound method, equal to
    `transformers.utils.get_json_schema(func)`; `ToolSchemaError` when it cannot be described."""
    name = getattr(func, "__name__", "operation")
    doc = inspect.getdoc(func)
    if not doc:
        raise ToolSchemaError(f"cannot describe tool {name}: it has no docstring (a description and an Args: block "
                              "describing every argument)")
    description, described, returns_doc = _docstring_parts(doc.strip())
    try:
        hints = get_type_hints(func)
    except Exception as e:  # an annotation that does not evaluate
        raise ToolSchemaError(f"cannot describe tool {name}: its type hints do not evaluate: {e}") from None
    signature = inspect.signature(func)
    first = next(iter(signature.parameters), None)
    receiver = first if first in {"self", "cls"} and signature.parameters[first].annotation is inspect.Parameter.empty \
        else None
    required = []
    for pname, param in signature.parameters.items():
        if pname == receiver:
            continue
        if param.annotation is inspect.Parameter.empty:
            raise ToolSchemaError(f"cannot describe tool {name}: argument {pname!r} has no type hint")
        if param.default is inspect.Parameter.empty:
            required.append(pname)
    properties: dict[str, dict] = {}
    for pname, hint in hints.items():
        if pname == receiver:
            continue
        try:
            properties[pname] = _hint_schema(hint)
        except _Unsupported as e:
            if pname == "return":  # the model never writes the return value: leave it out
                continue
            raise ToolSchemaError(f"cannot describe tool {name}: argument {pname!r}: {e}") from None
    parameters: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    returns = properties.pop("return", None)
    if returns is not None and returns_doc is not None:
        returns["description"] = returns_doc
    for pname, schema in properties.items():
        if pname not in described:
            raise ToolSchemaError(f"cannot describe tool {name}: its docstring's Args: block does not describe "
                                  f"argument {pname!r}")
        text = described[pname]
        choices = _CHOICES.search(text)
        if choices:
            try:
                values = json.loads(choices.group(1))
            except json.JSONDecodeError:
                raise ToolSchemaError(f"cannot describe tool {name}: argument {pname!r}: (choices: ...) is not a "
                                      f"JSON list: {choices.group(1)!r}") from None
            schema["enum"] = [c.strip() if isinstance(c, str) else c for c in values]
            text = text[: choices.start()].strip()
        schema["description"] = text
    out: dict[str, Any] = {"name": name, "description": description, "parameters": parameters}
    if returns is not None:
        out["return"] = returns
    return {"type": "function", "function": out}


def tool_schema(tool: Any) -> dict:
    """A tool as chat templates see it: a JSON-schema dict as given, a function or method described by
    `function_schema` (transformers takes exactly these two)."""
    if isinstance(tool, Mapping):
        return dict(tool)
    if inspect.isfunction(tool) or inspect.ismethod(tool):
        return function_schema(tool)
    raise ToolSchemaError(f"a tool must be a JSON-schema dict or a function with type hints and a docstring, "
                          f"got {type(tool).__name__}: {tool!r}")


def tool_parameters(tools: Sequence[Any]) -> dict[str, dict]:
    """name -> the parameters schema of each tool (schema dicts in OpenAI's {"type": "function",
    "function": {...}} form or the bare {"name", "parameters"} form, or functions)."""
    out: dict[str, dict] = {}
    for tool in tools:
        schema = tool_schema(tool)
        spec = schema.get("function", schema) if isinstance(schema.get("function"), Mapping) else schema
        name = spec.get("name")
        if not isinstance(name, str):
            raise ToolSchemaError(f"a tool schema must name its function: {schema!r}")
        params = spec.get("parameters")
        out[name] = dict(params) if isinstance(params, Mapping) else {"type": "object", "properties": {}}
    return out


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
