"""One step of an RLHF algorithm (or training stage) as a dataflow graph.

Every algorithm declares its step as a `CallGraph`; the executor
(`jaxrlhf.placement.executor`) runs it, the planner (`jaxrlhf.planner`)
estimates and places it, `python -m jaxrlhf.plan` prints it. This module is
pure data and JAX-free, so the planner can import it.

Nodes:
- `CallSpec`: a model call. `role` names the model (actor, critic, ref,
  reward), `kind` what it does with it (generate, inference, train), `head`
  which output head the role's model carries (lm, value, reward). Its
  `inputs` and `outputs` are names of values in the step.
- `HostStep`: logic that runs on the host between calls (scoring decoded
  text with rule rewards, shaping scores, KL control). Also named inputs
  and outputs.

Values come from three places: `feed` names are supplied from outside at
the start of a step (prompts, a random key); `state` names are carried from
one step to the next (a KL coefficient, value-normalisation moments): an
input named in `state` reads the value carried into the step, and an output
with that name becomes the value carried into the *next* step (it is not
visible within the step); every other name is the output of exactly one node.

The dependencies of a call (`CallSpec.deps`) are the model calls whose
outputs reach its inputs, directly or through host steps: what the planner's
simulator orders by. Graphs built for the planner alone may give `deps`
explicitly and leave inputs and outputs empty.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Union

CallKind = Literal["generate", "inference", "train"]
CALL_KINDS: tuple[str, ...] = ("generate", "inference", "train")
HEADS: tuple[str, ...] = ("lm", "value", "reward")


@dataclasses.dataclass(frozen=True)
class CallSpec:
    """One model call. `name` starts with the role: "actor.generate", "actor.generate_greedy"."""

    name: str
    role: str
    kind: CallKind
    head: str = "lm"
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    deps: tuple[str, ...] = ()  # calls of the same step this one waits for (derived from inputs + explicit)
    seqs_per_row: int = 1  # sequences the call sees per batch row (2 for chosen + rejected pairs)
    # lm head: which positions get full-vocabulary logits ("response": only those predicting the
    # response, as RL calls compute them; "all": every position, as SFT and DPO do)
    logit_positions: str = "response"
    # reads its role's trained weights as this step's update starts (an off-policy correction's recompute
    # of pi_old): it runs with the train calls, never dispatched ahead with its step's rollout, and never
    # on a shadow copy (away from home the trained weights are moved for it)
    fresh_weights: bool = False

    def __post_init__(self):
        if self.kind not in CALL_KINDS:
            raise ValueError(f"call {self.name!r}: kind {self.kind!r} is not one of {CALL_KINDS}")
        if self.head not in HEADS:
            raise ValueError(f"call {self.name!r}: head {self.head!r} is not one of {HEADS}")
        if self.name.split(".")[0] != self.role:
            raise ValueError(f"call {self.name!r} must start with its role: '{self.role}.<what>'")
        if self.kind == "train" and self.name != f"{self.role}.train":
            raise ValueError(f"a role trains in one call named '{self.role}.train', not {self.name!r}")
        if self.seqs_per_row < 1:
            raise ValueError(f"call {self.name!r}: seqs_per_row must be >= 1")
        if self.logit_positions not in ("response", "all"):
            raise ValueError(f"call {self.name!r}: logit_positions must be 'response' or 'all'")


@dataclasses.dataclass(frozen=True)
class HostStep:
    """Host-side logic between calls; the algorithm supplies the function under the same name.

    `shards_of` names calls whose batch split the step lays its outputs out for (a packed batch comes in
    whole blocks per data-parallel shard): the executor passes `shards={call: ways}`, the number of
    shards each call's batch is split into under the plan it runs."""

    name: str
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    shards_of: tuple[str, ...] = ()


Node = Union[CallSpec, HostStep]


@dataclasses.dataclass(frozen=True)
class CallGraph:
    """Calls and host steps of one step; see the module docstring for how values flow."""

    calls: tuple[CallSpec, ...]
    host_steps: tuple[HostStep, ...] = ()
    feed: tuple[str, ...] = ()
    state: tuple[str, ...] = ()

    def __post_init__(self):
        names = [n.name for n in self.nodes]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate node names in graph: {names}")
        producer: dict[str, str] = {}
        for node in self.nodes:
            for out in node.outputs:
                if out in self.state:
                    continue
                if out in producer or out in self.feed:
                    raise ValueError(f"value {out!r} is produced twice (by {producer.get(out, 'feed')} and {node.name})")
                producer[out] = node.name
        for node in self.nodes:
            for value in node.inputs:
                if value not in producer and value not in self.feed and value not in self.state:
                    raise ValueError(
                        f"{node.name!r} reads {value!r}, which no node produces and which is neither fed nor state"
                    )
        heads: dict[str, str] = {}
        for c in self.calls:
            if heads.setdefault(c.role, c.head) != c.head:
                raise ValueError(f"role {c.role!r} has calls with different heads ({heads[c.role]}, {c.head})")
        call_names = {c.name for c in self.calls}
        for c in self.calls:
            for d in c.deps:
                if d not in call_names:
                    raise ValueError(f"call {c.name!r} depends on unknown call {d!r}")
        # Resolve each call's dependencies through host steps and store them on the call.
        by_name = {n.name: n for n in self.nodes}

        def upstream_calls(node: Node, seen: set[str]) -> set[str]:
            found: set[str] = set()
            for value in node.inputs:
                src = producer.get(value)
                if src is None or src in seen:
                    continue
                seen.add(src)
                if isinstance(by_name[src], CallSpec):
                    found.add(src)
                else:
                    found |= upstream_calls(by_name[src], seen)
            return found

        resolved = []
        for c in self.calls:
            deps = set(c.deps) | upstream_calls(c, {c.name})
            resolved.append(dataclasses.replace(c, deps=tuple(n for n in names if n in deps)))
        object.__setattr__(self, "calls", tuple(resolved))
        object.__setattr__(self, "_order", self._resolve_order())  # raises on a cycle; the planner asks often

    def only(self, *names: str) -> "CallGraph":
        """The graph of just the calls `names` (no host steps): what they read from the rest is fed.
        Evaluation runs `actor.generate` alone this way."""
        unknown = [n for n in names if n not in self.names]
        if unknown:
            raise KeyError(f"no call(s) {unknown} in the graph; calls: {list(self.names)}")
        calls = tuple(dataclasses.replace(c, deps=tuple(d for d in c.deps if d in names))
                      for c in self.calls if c.name in names)
        made = {v for c in calls for v in c.outputs}
        feed = tuple(dict.fromkeys(v for c in calls for v in c.inputs if v not in made and v not in self.state))
        return CallGraph(calls, feed=feed, state=tuple(v for v in self.state if any(v in c.inputs for c in calls)))

    # ---- queries ---------------------------------------------------------------------
    @property
    def nodes(self) -> tuple[Node, ...]:
        return (*self.calls, *self.host_steps)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.calls)

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(c.role for c in self.calls))

    def head(self, role: str) -> str:
        for c in self.calls:
            if c.role == role:
                return c.head
        raise KeyError(f"role {role!r} has no call in the graph; roles: {list(self.roles)}")

    def __getitem__(self, name: str) -> CallSpec:
        for c in self.calls:
            if c.name == name:
                return c
        raise KeyError(f"unknown call {name!r}; the graph has {list(self.names)}")

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"unknown node {name!r}; the graph has {[n.name for n in self.nodes]}")

    def producer(self, value: str) -> Node | None:
        """The node whose output `value` is within a step (None for fed and carried values)."""
        for n in self.nodes:
            if value in n.outputs and value not in self.state:
                return n
        return None

    def order(self) -> tuple[Node, ...]:
        """Every node in an order that respects data and call dependencies (stable in declaration order)."""
        return self._order

    def _resolve_order(self) -> tuple[Node, ...]:
        done: list[str] = []
        available = set(self.feed) | set(self.state)
        remaining = list(self.nodes)
        while remaining:
            ready = [
                n for n in remaining
                if all(v in available for v in n.inputs)
                and all(d in done for d in (n.deps if isinstance(n, CallSpec) else ()))
            ]
            if not ready:
                raise ValueError(f"dependency cycle among {[n.name for n in remaining]}")
            node = ready[0]
            done.append(node.name)
            available |= {v for v in node.outputs if v not in self.state}
            remaining.remove(node)
        return tuple(self.node(n) for n in done)

    def topological(self) -> tuple[CallSpec, ...]:
        """The calls in dependency order."""
        return tuple(n for n in self.order() if isinstance(n, CallSpec))

    def train_call(self, role: str) -> CallSpec | None:
        for c in self.calls:
            if c.role == role and c.kind == "train":
                return c
        return None

    def downstream_of_training(self) -> frozenset[str]:
        """Names of the train calls, of the calls that need fresh weights (`CallSpec.fresh_weights`), and
        of every node that (transitively) reads their outputs."""
        seeds = [c for c in self.calls if c.kind == "train" or c.fresh_weights]
        tainted = {c.name for c in seeds}
        values = {v for c in seeds for v in c.outputs if v not in self.state}
        changed = True
        while changed:
            changed = False
            for n in self.nodes:
                if n.name not in tainted and any(v in values for v in n.inputs):
                    tainted.add(n.name)
                    values |= {v for v in n.outputs if v not in self.state}
                    changed = True
        return frozenset(tainted)
