"""The executor: runs any call graph (`jaxrlhf.graph.CallGraph`) on an execution plan.

For every model call it asks the plan where the call runs, brings the role's
parameters there (no move when the call runs where they live; the persistent
shadow copy for roles the plan shadows; otherwise a reallocation whose copy
is dropped after the call; for a role the plan offloads, a device copy of
its host-resident parameters; for a role whose optimizer state the plan
offloads, that state comes to device for the train call and goes back to
host memory after it), moves the call's inputs to that placement,
dispatches the function compiled for it and times it. Host steps run in
between on the values they name. Which function a call or host step runs is
the algorithm's business (`functions`, `host_steps`); the executor knows
nothing of RL.

Order within a step: every model call whose inputs are ready is dispatched
(asynchronously, so calls on disjoint device groups run at the same time;
all of their inputs are moved first) before any ready host step runs,
because host steps may wait for device results. A step has two phases:
*collect* (every node that does not depend on a train call) and *train* (the
train calls and what reads their outputs).
With a one-step off-policy plan the collect phase of step i+1 is dispatched
right after the train calls of step i, before the shadow copies are synced,
so the next rollout is generated on the previous weights while training runs.

Moves never block: a call's parameters and inputs each move in one batched
operation (`realloc.move_where_needed`), dispatched like the call itself, and
every operation of a step is recorded on a `Timeline` that explains the step's
time afterwards (compute, waiting, moves, host work). The host waits for
device values only where it needs them: the inputs of a host step, and the
values a step is asked to `read` (one gather at its end).

Call functions are pure (static parts bound by the algorithm):
    generate / inference:  fn(params, inputs: dict) -> dict of outputs
    train:                 fn(params, opt_state, inputs: dict) -> (params, opt_state, dict of outputs)
Inputs with a leading batch axis are split over the call's data x fsdp axes;
scalars (and pytrees of scalars, such as normalisation moments) are replicated.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np
import optax
from flax import nnx

from jaxrlhf.graph import CallGraph, CallSpec, HostStep, Node
from jaxrlhf.placement.calls import CallCache, Placed, PlacedFunction
from jaxrlhf.placement.layout import batch_axes
from jaxrlhf.placement.timeline import Op, StepTimes, Timeline, breakdown, device_ids
from jaxrlhf.planner.plan import ExecutionPlan, PlanError
from jaxrlhf.transfer.host import host_get
from jaxrlhf.transfer.realloc import (
    is_offloaded,
    move_where_needed,
    offload,
    put_host,
    reallocate,
    reload,
    tree_bytes,
)

CallFn = Callable[..., Any]
HostFn = Callable[..., Mapping[str, Any]]


@dataclasses.dataclass
class Role:
    """One model of the pipeline: structure, parameters at home, and (if trained) its optimizer."""

    name: str
    graphdef: nnx.GraphDef
    params: nnx.State
    optimizer: optax.GradientTransformation | None = None
    opt_state: Any = None
    shadow: nnx.State | None = None  # persistent copy at another placement (disaggregated plans)
    # The frozen part of role `base_of` (what its optimizer never updates: a LoRA actor's base), shared,
    # not copied: a reference model that is the LoRA actor's base holds no parameters of its own
    # (`params` is None; the source's optimizer has a `split`, as `algorithms.optim.PartialOptimizer`).
    base_of: str | None = None

    @property
    def trainable(self) -> bool:
        return self.optimizer is not None


@dataclasses.dataclass
class MoveStats:
    """Bytes moved in one step: parameters (reallocation, shadow sync) and batches (call inputs). Their
    times are on the step's timeline."""

    realloc_bytes: int = 0
    transfer_bytes: int = 0

    def metrics(self) -> dict[str, float]:
        return {"realloc/bytes": float(self.realloc_bytes), "transfer/bytes": float(self.transfer_bytes)}


@dataclasses.dataclass
class StepResult:
    """Every value of one step (device arrays still on device, the `read` ones on host) and where its
    time went."""

    values: dict[str, Any]
    times: StepTimes
    moves: MoveStats

    @property
    def seconds(self) -> float:
        return self.times.seconds

    def metrics(self) -> dict[str, float]:
        """The step's timing metrics: the breakdown (`jaxrlhf.placement.timeline`) and bytes moved."""
        return {**self.times.metrics(), **self.moves.metrics()}


def delete_tree(tree: Any) -> None:
    """Free the device buffers of every array in `tree`."""
    for x in jax.tree_util.tree_leaves(tree):
        if isinstance(x, jax.Array) and not x.is_deleted():
            x.delete()


class Executor:
    """Owns the roles of one graph under one plan and runs its steps."""

    def __init__(
        self,
        plan: ExecutionPlan,
        graph: CallGraph,
        roles: Mapping[str, Role],
        *,
        cache: CallCache,
        functions: Mapping[str, CallFn],
        host_steps: Mapping[str, HostFn] | None = None,
        state: Mapping[str, Any] | None = None,
    ):
        missing = [c.name for c in graph.calls if c.name not in functions]
        if missing:
            raise ValueError(f"no function for call(s) {missing}")
        host_steps = dict(host_steps or {})
        missing = [h.name for h in graph.host_steps if h.name not in host_steps]
        if missing:
            raise ValueError(f"no function for host step(s) {missing}")
        unplaced = [c for c in graph.names if c not in plan.calls]
        if unplaced:
            raise PlanError(f"plan has no placement for call(s) {unplaced}")
        for c in graph.calls:
            if c.kind == "generate" and plan.calls[c.name].layout.stage > 1:
                raise PlanError(f"call {c.name!r}: generation is never pipelined; give it a layout with stage=1 "
                                f"(got {plan.calls[c.name].layout})")
            if c.role not in roles:
                raise ValueError(f"call {c.name!r} needs role {c.role!r}; roles given: {sorted(roles)}")
            if c.kind == "train" and not roles[c.role].trainable:
                raise ValueError(f"call {c.name!r} trains role {c.role!r}, which has no optimizer")
        self.plan = plan
        self.graph = graph
        self.roles = dict(roles)
        self.cache = cache
        self.functions = dict(functions)
        self.host_steps = host_steps
        self.state: dict[str, Any] = dict(state or {})
        missing = [s for s in graph.state if s not in self.state]
        if missing:
            raise ValueError(f"no initial value for carried state {missing}")
        self.moves = MoveStats()
        self.timeline = Timeline()
        self._cpu = jax.devices()[0].platform == "cpu"
        self._ops: list[Op] = []  # operations of the phase being dispatched
        self._training = graph.downstream_of_training()
        self.offload_idle()
        # the collect phases of the next steps, dispatched ahead on an off-policy plan, oldest first
        self._pending: collections.deque[tuple[dict[str, Any], list[Op]]] = collections.deque()

    # ---------------------------------------------------------------- placement helpers
    def placed(self, call: str) -> Placed:
        return self.cache.placed(call)

    def home_placed(self, role: str) -> Placed:
        return self.placed(self.plan.home_call(role))

    def move(
        self, tree: Any, shardings: Any, *, call: str, params: bool = True, copy: bool = False
    ) -> Any:
        """Reshard `tree` device to device (no host round trip) for `call`, in one batched operation that is
        dispatched, not waited for; no-op where already in place.

        With `copy` a leaf already in place is copied too, so the result shares no buffer with `tree`:
        needed for a copy that is dropped after its call or outlives a train call that donates `tree`
        (two layouts can lay a leaf out identically, e.g. one replicated over both meshes' extra axes).
        Parameter moves count as reallocation, batch moves as transfers (separate metrics).
        """
        sources = device_ids(tree)
        self._serialise(sources | device_ids(shardings))
        moved, stats = (reallocate if copy else move_where_needed)(tree, shardings, block=False)
        if stats.leaves:
            what = "params" if params else "batch"
            self._ops.append(self.timeline.device("move", call, moved, sources | device_ids(moved), what=what,
                                                  nbytes=stats.bytes))
            if params:
                self.moves.realloc_bytes += stats.bytes
            else:
                self.moves.transfer_bytes += stats.bytes
        return moved

    def _serialise(self, devices: frozenset[int]) -> None:
        """On CPU, wait for the work already dispatched to any of `devices` before dispatching more: XLA:CPU
        runs independent programs on the same devices at the same time, and two multi-device programs
        then compete for the same cores and for the rendezvous of their collectives (measured: each twice
        as slow). Accelerators run a device's programs in order, so there nothing waits."""
        if self._cpu:
            self.timeline.wait_for_devices(devices)

    def place_inputs(self, inputs: Mapping[str, Any], call: str) -> dict[str, Any]:
        """Every input of `call` on its placement: batch-major arrays split over the batch axes,
        scalars replicated. Host arrays are put there directly, device arrays moved device to device,
        all in one move."""
        placed = self.placed(call)

        def target(x: Any) -> jax.sharding.Sharding:
            return placed.batch_sharding(np.ndim(x)) if np.ndim(x) else placed.replicated()

        for name, value in inputs.items():
            for leaf in jax.tree_util.tree_leaves(value):
                if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float, bool)):
                    raise TypeError(
                        f"call {call!r}: input {name!r} holds a {type(leaf).__name__}; model calls take arrays "
                        "(turn host values into arrays in a host step)"
                    )
        inputs = dict(inputs)
        return self.move(inputs, jax.tree_util.tree_map(target, inputs), call=call, params=False)

    def offload_idle(self) -> None:
        """Keep the roles the plan offloads in host memory (they come back for each of their calls), and
        the optimizer state of the roles in `plan.offload_optimizer` (it comes back for each train call).

        Call again after replacing their parameters or optimizer state (a checkpoint restore)."""
        for name in self.plan.offload_roles:
            role = self.roles.get(name)
            if role is not None and role.base_of is None and not is_offloaded(role.params):
                role.params = offload(role.params)
        for name in self.plan.offload_optimizer:
            role = self.roles.get(name)
            if role is not None and role.trainable and not is_offloaded(role.opt_state):
                role.opt_state = offload(role.opt_state)

    def opt_state_for(self, role: Role, call: str) -> Any:
        """The role's optimizer state on device for its train call `call`: a host -> device copy where the
        plan keeps it in host memory, waited for (the call needs all of it) before the host copy is freed
        (the call writes a new state). Its timeline op holds no arrays: the call donates them at once, and
        a waiter still looking at a donated array could not tell when it was ready."""
        if not is_offloaded(role.opt_state):
            return role.opt_state
        dispatched = time.perf_counter()
        state = reload(role.opt_state, free_source=True)
        self._ops.append(self.timeline.device("move", call, (), device_ids(state), what="opt_reload",
                                              nbytes=tree_bytes(state), dispatched=dispatched))
        return state

    def park_opt_state(self, role: Role, call: str) -> None:
        """Send the optimizer state a train call just wrote back to host memory (`plan.offload_optimizer`).
        Dispatched, not waited for, so what follows the train call (an off-policy plan's next rollout) is
        dispatched at once; the device copy is freed when its transfer is done."""
        if role.name not in self.plan.offload_optimizer:
            return
        role.opt_state = offload(role.opt_state, free_source=False)
        self._ops.append(self.timeline.device("move", call, role.opt_state, device_ids(role.opt_state),
                                              what="opt_offload", nbytes=tree_bytes(role.opt_state)))

    def params_for(self, role_name: str, call: str) -> tuple[nnx.State, bool]:
        """The role's parameters on `call`'s placement, and whether that copy is temporary (it is freed
        once the call that uses it is done: nothing else holds it)."""
        role = self.roles[role_name]
        placed = self.placed(call)
        if role.base_of is not None:  # the base of a LoRA role: its frozen weights, moved only where needed
            source = self.roles[role.base_of]
            base = source.optimizer.split(source.params)[1]
            if placed.placement == self.home_placed(role.base_of).placement:
                return base, False
            return self.move(base, placed.param_shardings(base), call=call, copy=True), True
        if is_offloaded(role.params):  # host -> device for this call only; the host copy stays
            home = reload(role.params, free_source=False)
            self._ops.append(self.timeline.device("move", call, home, device_ids(home), what="reload",
                                                  nbytes=tree_bytes(home)))
            if placed.placement == self.home_placed(role_name).placement:
                return home, True
            return self.move(home, placed.param_shardings(role.params), call=call), True
        if placed.placement == self.home_placed(role_name).placement:
            return role.params, False
        shardings = placed.param_shardings(role.params)
        fresh = call in self.graph.names and self.graph[call].fresh_weights  # the trained weights, not a shadow's
        if role_name in self.plan.shadow_roles and not fresh:
            if role.shadow is None:
                role.shadow = self.move(role.params, shardings, call=call, copy=True)
            return role.shadow, False
        return self.move(role.params, shardings, call=call, copy=True), True

    def sync_shadows(self) -> None:
        """Push freshly trained weights to every shadow copy (disaggregated plans). The old copy is
        dropped, not deleted: a rollout still running on it (off-policy) keeps it until it is done."""
        for name in self.plan.shadow_roles:
            role = self.roles.get(name)
            if role is None or role.shadow is None:
                continue
            split = getattr(role.optimizer, "split", None)  # LoRA (`PartialOptimizer`): the base never changes
            if split is None:
                target = jax.tree_util.tree_map(lambda x: x.sharding, role.shadow)
                role.shadow = self.move(role.params, target, call=f"{name}.sync", copy=True)
                continue
            old_trained, frozen = split(role.shadow)  # only the adapters travel; the shadow keeps its base
            target = jax.tree_util.tree_map(lambda x: x.sharding, old_trained)
            trained = self.move(split(role.params)[0], target, call=f"{name}.sync", copy=True)
            role.shadow = nnx.merge_state(frozen, trained)

    def function(self, call: str) -> PlacedFunction:
        """The call's function compiled for its placement; shardings follow the (committed) arguments.

        Train calls donate parameters and optimizer state: the update is written into their buffers,
        so one copy of each exists during a step (what the planner's memory model assumes)."""
        kind = self.graph[call].kind
        donate = (0, 1) if kind == "train" else ()
        return self.cache.function(call, self.functions[call], in_shardings=None, out_shardings=None,
                                   donate_argnums=donate, kind=kind)

    def _state_placed(self, name: str) -> Placed:
        """Where carried value `name` lives: replicated where the first call that reads it runs."""
        readers = {v: n.name for n in reversed(self.graph.order()) if isinstance(n, CallSpec) for v in n.inputs}
        return self.placed(readers.get(name, self.graph.calls[0].name))

    def commit_state(self) -> dict[str, Any]:
        """Make every carried value a device array (replicated where the first call that reads it
        runs), so checkpoints save and restore it like any other array; returns the state."""
        for name, value in self.state.items():
            placed = self._state_placed(name)
            self.state[name] = jax.tree_util.tree_map(
                lambda x: x if isinstance(x, jax.Array) and x.committed
                else put_host(x, placed.replicated()),
                value,
            )
        return self.state

    def moved_to(self, plan: ExecutionPlan, cache: CallCache) -> "Executor":
        """An executor for `plan` (with `cache` compiled for it) that owns this one's roles and carried
        state, resharded device to device onto the new plan: each role's parameters and optimizer state
        to its new home placement, carried values to where their first reader runs. Shadow copies are
        dropped (the new plan makes its own where it needs them) and offloaded roles and optimizer
        states come back to device first (the new executor offloads what its plan offloads). Values are moved, never
        recomputed, so the run's math does not change: the live switch of a re-plan. Call it between
        steps; this executor must not be used afterwards."""
        if self._pending:
            raise RuntimeError("cannot switch plans while the next step's rollout is in flight (off-policy plan)")
        for role in self.roles.values():
            if role.shadow is not None:
                delete_tree(role.shadow)
                role.shadow = None
        for name, role in self.roles.items():
            if role.base_of is not None:  # runs on its source's base: nothing of its own to move
                continue
            placed = cache.placed(plan.home_call(name))
            if is_offloaded(role.params):
                role.params = reload(role.params)
            if role.trainable and is_offloaded(role.opt_state):
                role.opt_state = reload(role.opt_state)
            role.params, _ = move_where_needed(role.params, placed.param_shardings(role.params), free_source=True)
            if role.trainable:
                target = placed.opt_state_shardings(role.optimizer, role.params)
                role.opt_state, _ = move_where_needed(role.opt_state, target, free_source=True)
        new = Executor(plan, self.graph, self.roles, cache=cache, functions=self.functions,
                       host_steps=self.host_steps, state=self.state)
        for name, value in new.state.items():
            target = jax.tree_util.tree_map(lambda _: new._state_placed(name).replicated(), value)
            new.state[name], _ = move_where_needed(value, target, free_source=True)
        jax.block_until_ready((new.state, [(r.params, r.opt_state) for r in self.roles.values()]))
        return new

    # ---------------------------------------------------------------- running nodes
    def run_call(self, spec: CallSpec, args: Mapping[str, Any]) -> dict[str, Any]:
        """Dispatch one model call on its placement, its inputs `args` already there (`place_inputs`);
        train calls update the role in place."""
        role = self.roles[spec.role]
        params, _ = self.params_for(spec.role, spec.name)
        fn = self.function(spec.name)
        devices = frozenset(d.id for d in self.placed(spec.name).mesh.devices.flat)
        self._serialise(devices)
        call_args = (params, self.opt_state_for(role, spec.name), args) if spec.kind == "train" else (params, args)
        with jax.profiler.TraceAnnotation(spec.name):
            program = fn.compiled(*call_args)  # compiled on first use: compiling is not the call's time
            dispatched = time.perf_counter()  # XLA:GPU's launch runs the program's while loops (timeline.py)
            result = program(*call_args)
        if spec.kind == "train":
            role.params, role.opt_state, out = result
            done = (role.params, out)
            self.park_opt_state(role, spec.name)
        else:
            out = done = result
        self._ops.append(self.timeline.device("compute", spec.name, done, devices, dispatched=dispatched))
        return self._checked(spec, out)

    def run_host(self, step: HostStep, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """A host step gets host values: device arrays are gathered (the same on every process); one that
        names calls in `shards_of` also gets how many shards each call's batch is split into."""
        with self.timeline.host(step.name, self._ops):
            kwargs = host_get(dict(inputs))
            if step.shards_of:
                kwargs["shards"] = {call: self.batch_shards(call) for call in step.shards_of}
            return self._checked(step, self.host_steps[step.name](**kwargs))

    def batch_shards(self, call: str) -> int:
        """How many shards `call`'s batch is split into on its placement (its data x fsdp x expert ways; a mesh
        has the expert axis only where the layout has one)."""
        mesh = self.placed(call).mesh
        return math.prod(mesh.shape.get(a, 1) for a in batch_axes(self.cache.rules))

    @staticmethod
    def _checked(node: Node, out: Mapping[str, Any]) -> dict[str, Any]:
        out = dict(out)
        if set(out) != set(node.outputs):
            raise ValueError(
                f"{node.name!r} returned {sorted(out)} but the graph declares outputs {sorted(node.outputs)}"
            )
        return out

    def _run_phase(self, nodes: list[Node], values: dict[str, Any],
                   overlap: Callable[[], None] | None = None) -> None:
        """Run `nodes` as their inputs become available: ready calls first, then one host step.
        `overlap` (optional) runs once, before the first host step (which may wait for the calls
        dispatched so far) or at the end: host work that goes on while those calls run."""
        done = set(values) | set(self.graph.state)
        finished: set[str] = set()
        pending = list(nodes)
        while pending:
            ready = [
                n for n in pending
                if all(v in done for v in n.inputs)
                and all(d in finished or d not in {p.name for p in nodes}
                        for d in (n.deps if isinstance(n, CallSpec) else ()))
            ]
            calls = [n for n in ready if isinstance(n, CallSpec)]
            batch = calls or ready[:1]
            if not batch:
                raise RuntimeError(f"cannot run {[n.name for n in pending]}: inputs never become available")
            if overlap is not None and not calls:
                overlap()
                overlap = None
            inputs_of = {
                node.name: {v: (self.state[v] if v in self.graph.state else values[v]) for v in node.inputs}
                for node in batch
            }
            # Every ready call's inputs move before any of them is dispatched: on CPU a move waits for the
            # work on its source devices, so moving the second call's inputs after dispatching the first
            # would wait for the first call to finish and run calls on disjoint groups one after another.
            if calls:
                inputs_of = {node.name: self.place_inputs(inputs_of[node.name], node.name) for node in calls}
            for node in batch:
                if isinstance(node, CallSpec):
                    out = self.run_call(node, inputs_of[node.name])
                else:
                    out = self.run_host(node, inputs_of[node.name])
                for k, v in out.items():
                    values[f"next:{k}" if k in self.graph.state else k] = v
                done |= set(out)
                finished.add(node.name)
                pending.remove(node)
        if overlap is not None:
            overlap()

    def collect(self, feed: Mapping[str, Any]) -> tuple[dict[str, Any], list[Op]]:
        """The collect phase of a step (everything that does not depend on training), dispatched; returns
        its values and operations. A node whose outputs the feed already holds is not run (a rollout that
        produces the generate call's outputs itself hands them in: `jaxrlhf.rollouts`)."""
        missing = [f for f in self.graph.feed if f not in feed]
        if missing:
            raise ValueError(f"step feed lacks {missing}")
        values = dict(feed)
        outer, self._ops = self._ops, []
        try:
            self._run_phase([n for n in self.graph.order() if n.name not in self._training
                             and not (n.outputs and set(n.outputs) <= set(feed))], values)
            return values, self._ops
        finally:
            self._ops = outer

    def step(
        self, feed: Mapping[str, Any], ahead: Sequence[Mapping[str, Any]] = (), read: Sequence[str] = (),
        overlap: Callable[[], None] | None = None,
    ) -> StepResult:
        """One step of the graph; the values named in `read` come back on host, read in one gather once
        everything else is dispatched. On an off-policy plan, `ahead` holds the feeds of later steps to
        start now: their collect phases run on the shadow generator (the weights it was last synced
        with) while this step trains, and the next calls of `step` use them in order, ignoring their
        own `feed`. `overlap` runs on the host while the train calls run (a streaming generator's
        decode chunks), before the shadows are synced."""
        if ahead and not self.plan.offpolicy:
            raise ValueError(f"plan {self.plan.strategy!r} is not off-policy: it cannot start later steps' rollouts")
        t_start = time.perf_counter()
        self.moves = MoveStats()
        if self._pending:
            values, self._ops = self._pending.popleft()
        else:
            values, self._ops = self.collect(feed)
        self._run_phase([n for n in self.graph.order() if n.name in self._training], values, overlap)
        for later in ahead:  # overlaps the train calls: shadows sync after this
            self._pending.append(self.collect(later))
        self.sync_shadows()
        for name in self.graph.state:  # carried into the next step
            if f"next:{name}" in values:
                self.state[name] = values.pop(f"next:{name}")
        wanted = [k for k in read if k in values]
        if wanted:
            with self.timeline.host("read", self._ops):
                values.update(host_get({k: values[k] for k in wanted}))
        ops = self._ops
        self.timeline.finish(ops)
        return StepResult(values, breakdown(ops, t_start, time.perf_counter()), self.moves)

    def run_at(self, call: str, fn: CallFn, inputs: Mapping[str, Any]) -> Any:
        """Run `fn(params, inputs)` on `call`'s placement with its role's parameters brought there
        (evaluation: work that is not part of the step graph). Returns host values, the same on every
        process."""
        role = self.graph[call].role
        outer, self._ops = self._ops, []
        try:
            params, _ = self.params_for(role, call)
            out = self.cache.function(call, fn, in_shardings=None, out_shardings=None)(params, self.place_inputs(inputs, call))
            del params
            out = host_get(out)
            self.timeline.finish(self._ops)
            return out
        finally:
            self._ops = outer
