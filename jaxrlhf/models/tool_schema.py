"""Tool definitions as JSON schemas, the form chat templates describe tools in (no JAX).

A chat template describes its tools from JSON schemas
(`{"type": "function", "function": {"name", "description", "parameters"}}`). `tool_schema(tool)`
takes such a dict as is, or writes one for a Python function exactly as transformers'
`get_json_schema` does (its type hints and its Google-style docstring: a description, an `Args:`
block describing every argument, optionally `Returns:` and `(choices: [...])` at the end of an
argument's line), so a rendered prompt is byte-identical to `apply_chat_template(..., tools=[f])`.
A function it cannot describe (no docstring, an argument without a type hint or a description, a
type with no JSON form) raises `ToolSchemaError` naming the function and what is missing.

Why here: the chat template (`models.chat_template`) renders these; parsing the calls a model writes
back is the environments' business (`jaxrlhf.environments.tool_calls`).
"""

from __future__ import annotations

import enum
import inspect
import json
import re
import types
from typing import Any, Callable, Literal, Mapping, Sequence, Union, get_args, get_origin, get_type_hints


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
