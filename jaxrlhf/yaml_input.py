"""YAML a user wrote (configs, plan files, hardware profiles), read with limits: a repeated key is an
error (PyYAML keeps the last one without a word) and aliases may not expand past MAX_ALIAS_NODES (a
"billion laughs" document is a few lines). Imports only PyYAML, so every layer can use it."""

from __future__ import annotations

from typing import Any

import yaml

# Nodes that aliases may add to a document. Normal configs use a handful; nested anchors
# ("billion laughs") would otherwise expand a few lines into billions of nodes once walked.
MAX_ALIAS_NODES = 10_000


class InputLimit(yaml.MarkedYAMLError):
    """A YAML document that parses but is refused: a repeated key, an oversized alias expansion."""


class LimitedLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (PyYAML keeps the last one without a word) and
    bounds what aliases expand to; both are checked while composing, before any value is built."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._sizes: dict[int, int] = {}  # id(node) -> nodes in its full expansion
        self._alias_nodes = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        is_alias = self.check_event(yaml.AliasEvent)
        mark = self.peek_event().start_mark
        node = super().compose_node(parent, index)
        if is_alias:
            if id(node) not in self._sizes:
                raise InputLimit(problem="an alias refers to a node that contains it", problem_mark=mark)
            self._alias_nodes += self._sizes[id(node)]
            if self._alias_nodes > MAX_ALIAS_NODES:
                raise InputLimit(
                    problem=f"YAML aliases expand to more than {MAX_ALIAS_NODES:,} nodes; write the values out instead",
                    problem_mark=mark,
                )
        else:
            children = node.value if isinstance(node, yaml.SequenceNode) else []
            if isinstance(node, yaml.MappingNode):
                children = [child for pair in node.value for child in pair]
            self._sizes[id(node)] = 1 + sum(self._sizes[id(child)] for child in children)
        return node

    def compose_mapping_node(self, anchor: Any) -> Any:
        node = super().compose_mapping_node(anchor)
        first_line: dict[tuple[str, str], int] = {}
        for key, _ in node.value:
            if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
                continue
            if (key.tag, key.value) in first_line:
                raise InputLimit(
                    problem=f"duplicate key {key.value!r} (first set on line {first_line[key.tag, key.value]})",
                    problem_mark=key.start_mark,
                )
            first_line[key.tag, key.value] = key.start_mark.line + 1
        return node


def load(text: str) -> Any:
    """YAML `text` as Python values (SafeLoader's types); raises InputLimit or yaml.YAMLError."""
    return yaml.load(text, Loader=LimitedLoader)  # a SafeLoader subclass


def read(text: str, where: str) -> Any:
    """`load`, with every refusal one line that names `where` and the line (ValueError)."""
    try:
        return load(text)
    except InputLimit as e:
        raise ValueError(f"{where}, line {e.problem_mark.line + 1}: {e.problem}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = "; ".join(p for p in (getattr(e, "context", None), getattr(e, "problem", None)) if p)
        raise ValueError(f"{where} is not valid YAML{at}: {problem or ' '.join(str(e).split())}") from None
