"""The reference of every config key: its default and its one-line meaning, generated from the schema.

    python -m jaxrlhf.config_reference > docs/config_reference.md

Meanings are the schema's own comments (the one after a field, or the lines just above it), so
the reference cannot drift from the code; tests/test_config.py checks the checked-in file is
current. The `algorithm` table says which algorithms read each key (`ALGORITHM_CONFIGS`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import io
import sys
import tokenize
from typing import Any

import yaml

from jaxrlhf.config import to_dict
from jaxrlhf.config_schema import ALGORITHM_CONFIGS, AlgorithmConfig, Config, RolloutConfig

HEADER = """# Config reference

Every key of a run config, its default and what it means. Generated from `jaxrlhf/config_schema.py`
by `python -m jaxrlhf.config_reference > docs/config_reference.md` (a test checks it is current).
A YAML file sets any subset of these keys and `key=value` arguments override it
(`python -m jaxrlhf.train --config FILE [key=value ...]`); `--print-config` prints the result.
An `algorithm` key that the algorithm `algorithm.name` picks does not read (the `read by` column)
is an error that names the keys it does read; where the algorithms' defaults differ, the `default`
column gives the most common one, then each other algorithm's own (`--print-config` shows the value
a run uses). Naming an algorithm gives it its defaults: `algorithm.name=grpo` over a config of another
algorithm keeps the keys set to other values than that algorithm's defaults and takes GRPO's for the rest.
"""


@functools.cache
def _comments(cls: type) -> dict[str, str]:
    """Field name -> its comment in `cls`'s source (the lines just above, then the one after it)."""
    source = inspect.getsource(cls)
    above: list[str] = []
    out: dict[str, str] = {}
    line_tokens: dict[int, list[tokenize.TokenInfo]] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        line_tokens.setdefault(tok.start[0], []).append(tok)
    for _, toks in sorted(line_tokens.items()):
        kinds = [t for t in toks if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)]
        if len(kinds) == 1 and kinds[0].type == tokenize.COMMENT:  # a comment line: part of the next field's
            above.append(kinds[0].string.lstrip("# ").strip())
            continue
        field = len(kinds) >= 2 and kinds[0].type == tokenize.NAME and kinds[0].start[1] == 4 and kinds[1].string == ":"
        if field:
            inline = [t.string.lstrip("# ").strip() for t in kinds if t.type == tokenize.COMMENT]
            out[kinds[0].string] = "; ".join(part for part in (" ".join(above), *inline) if part)
        above = []
    return out


def meaning(cls: type, name: str) -> str:
    """The comment of field `name` of section `cls` (looked up in the class that defines it, or the
    class it overrides a default of)."""
    for klass in cls.__mro__:
        if name in getattr(klass, "__annotations__", {}) and _comments(klass).get(name):
            return _comments(klass)[name]
    return ""


def _default(value: Any) -> str:
    text = yaml.safe_dump(to_dict(value), default_flow_style=True, width=10_000).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _table(section: Any, prefix: str) -> list[str]:
    """A section's keys, defaults and meanings; a section of per-role sections (model, optimizer)
    has one default column per role."""
    fields = dataclasses.fields(section)
    values = [getattr(section, f.name) for f in fields]
    roles = [f.name for f, v in zip(fields, values) if dataclasses.is_dataclass(v)]
    inner = type(values[0]) if roles else None
    lines = []
    if roles and all(type(getattr(section, r)) is inner for r in roles):
        lines += [f"| key | {' | '.join(roles)} | meaning |", "| --- |" + " --- |" * (len(roles) + 1)]
        for f in dataclasses.fields(inner):
            defaults = " | ".join(f"`{_cell(_default(getattr(getattr(section, r), f.name)))}`" for r in roles)
            lines.append(f"| `{prefix}.<role>.{f.name}` | {defaults} | {_cell(_meaning(inner, f.name))} |")
        fields = [f for f in fields if f.name not in roles]
        if not fields:
            return lines
        lines.append("")
    lines += ["| key | default | meaning |", "| --- | --- | --- |"]
    for f in fields:
        default = _default(getattr(section, f.name))
        lines.append(f"| `{prefix}.{f.name}` | `{_cell(default)}` | {_cell(_meaning(type(section), f.name))} |")
    return lines


def _algorithm_table() -> list[str]:
    """Every algorithm key once, with the algorithms that read it (those whose class has it)."""
    lines = ["| key | default | read by | meaning |", "| --- | --- | --- | --- |"]
    seen: set[str] = set()
    rl = [n for n, c in ALGORITHM_CONFIGS.items() if issubclass(c, RolloutConfig)]
    for cls in dict.fromkeys(ALGORITHM_CONFIGS.values()):
        for klass in reversed(cls.__mro__):  # base keys first
            for f in dataclasses.fields(klass) if dataclasses.is_dataclass(klass) else ():
                if f.name in seen:
                    continue
                seen.add(f.name)
                names = [n for n, c in ALGORITHM_CONFIGS.items() if f.name in c.__dataclass_fields__]
                readers = ("all" if len(names) == len(ALGORITHM_CONFIGS) else
                           "every RL algorithm" if names == rl else ", ".join(names))
                default = _per_algorithm({n: _default(getattr(ALGORITHM_CONFIGS[n](), f.name)) for n in names})
                lines.append(f"| `algorithm.{f.name}` | {default} | {readers} | {_cell(_meaning(klass, f.name))} |")
    return lines


def _per_algorithm(defaults: dict[str, str]) -> str:
    """A key's default for the algorithms that read it: one value, or the most common one (the first
    reader's on a tie) followed by each other value and its algorithms."""
    by_value: dict[str, list[str]] = {}
    for name, value in defaults.items():
        by_value.setdefault(value, []).append(name)
    (common, _), *others = sorted(by_value.items(), key=lambda item: -len(item[1]))
    return "; ".join([f"`{_cell(common)}`", *(f"{', '.join(names)}: `{_cell(value)}`" for value, names in others)])


def _meaning(cls: type, name: str) -> str:
    text = meaning(cls, name)
    if not text:
        raise ValueError(f"config key {cls.__name__}.{name} has no comment in jaxrlhf/config_schema.py: add one")
    return text


def _doc(cls: type) -> str:
    return " ".join((inspect.getdoc(cls) or "").split("\n\n")[0].split())


def reference() -> str:
    """The whole reference as Markdown."""
    config = Config()
    lines = [HEADER.rstrip()]
    for f in dataclasses.fields(config):
        section = getattr(config, f.name)
        lines += ["", f"## {f.name}", ""]
        if f.name == "algorithm":
            lines += [_doc(AlgorithmConfig), ""]
            lines += _algorithm_table()
            continue
        lines += [_doc(type(section)), ""]
        lines += _table(section, f.name)
    return "\n".join(lines) + "\n"


def main() -> int:
    sys.stdout.write(reference())
    return 0


if __name__ == "__main__":
    sys.exit(main())
