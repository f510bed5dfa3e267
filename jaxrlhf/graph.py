"""A model-call dataflow graph, as the placement layer sees it.

The placement layer knows calls only by name, role and kind; which algorithm
produced the graph (PPO, GRPO, ...) is `jaxrlhf.ppo`'s business.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

CallKind = Literal["generate", "inference", "train"]
CALL_KINDS: tuple[str, ...] = ("generate", "inference", "train")


@dataclasses.dataclass(frozen=True)
class CallSpec:
    """One model call: `name` is "<role>.<kind>", e.g. "actor.generate"."""

    name: str
    role: str
    kind: CallKind
    deps: tuple[str, ...] = ()  # calls of the same step whose outputs this call needs

    def __post_init__(self):
        if self.kind not in CALL_KINDS:
            raise ValueError(f"call {self.name!r}: kind {self.kind!r} is not one of {CALL_KINDS}")


@dataclasses.dataclass(frozen=True)
class CallGraph:
    calls: tuple[CallSpec, ...]

    def __post_init__(self):
        names = [c.name for c in self.calls]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate call names in graph: {names}")
        for c in self.calls:
            for d in c.deps:
                if d not in names:
                    raise ValueError(f"call {c.name!r} depends on unknown call {d!r}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.calls)

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(c.role for c in self.calls))

    def __getitem__(self, name: str) -> CallSpec:
        for c in self.calls:
            if c.name == name:
                return c
        raise KeyError(f"unknown call {name!r}; the graph has {list(self.names)}")

    def topological(self) -> tuple[CallSpec, ...]:
        """Calls in an order that respects deps (stable with respect to declaration order)."""
        done: list[str] = []
        remaining = list(self.calls)
        while remaining:
            ready = [c for c in remaining if all(d in done for d in c.deps)]
            if not ready:
                raise ValueError(f"dependency cycle among {[c.name for c in remaining]}")
            done.append(ready[0].name)
            remaining.remove(ready[0])
        return tuple(self[n] for n in done)

    def train_call(self, role: str) -> CallSpec | None:
        for c in self.calls:
            if c.role == role and c.kind == "train":
                return c
        return None
