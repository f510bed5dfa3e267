"""Model calls bound to their placement: meshes, shardings and compiled functions.

`CallCache(plan)` turns each call's placement into a `Placed` (mesh plus
sharding helpers) and hands out `PlacedFunction`s: a function jitted with
in/out shardings on that placement, traced with the placement's activation
rules installed, and compiled once per shape bucket (the abstract signature
of its arguments). Pad variable lengths with `jaxrlhf.models.lengths.bucket_length` so a run
compiles a handful of shapes, not one per batch.

Calling a `PlacedFunction` only dispatches: nothing waits for the result, so
calls on disjoint device groups issued one after another run at the same
time. Synchronise (e.g. `jax.block_until_ready`) only where a value is needed
on host.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Sequence

import jax
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrlhf.models import axes as ax
from jaxrlhf.models import pipeline
from jaxrlhf.placement.devices import Device
from jaxrlhf.placement.layout import (
    DEFAULT_RULES,
    STAGE_AXIS,
    AxisRules,
    activation_resolver,
    batch_spec,
    make_mesh,
    optimizer_spec,
    param_shardings,
)
from jaxrlhf.planner.plan import DeviceGroup, ExecutionPlan, Placement, PlanError


@dataclasses.dataclass(frozen=True)
class Placed:
    """One call's placement made concrete: its mesh and how things are laid out on it."""

    call: str
    placement: Placement
    group: DeviceGroup
    mesh: Mesh
    rules: AxisRules = DEFAULT_RULES

    def param_shardings(self, tree: Any) -> Any:
        """NamedSharding per parameter, from its logical axes."""
        return param_shardings(tree, self.mesh, self.rules)

    def opt_state_shardings(self, optimizer: optax.GradientTransformation, params: Any) -> Any:
        """Optimizer state laid out like the parameters it mirrors and split further over the data-parallel
        axes (ZeRO-1, `layout.optimizer_spec`); counters replicated. An optimizer over part of the parameters
        (LoRA, `PartialOptimizer`) says which part with `trainable_params`."""
        params = getattr(optimizer, "trainable_params", lambda p: p)(params)
        shapes = jax.eval_shape(optimizer.init, params)
        return optax.tree_map_params(
            optimizer,
            lambda leaf, s: NamedSharding(self.mesh, optimizer_spec(s.spec, leaf.shape, self.mesh), s.memory_kind),
            shapes,
            self.param_shardings(params),
            transform_non_params=lambda t: jax.tree_util.tree_map(lambda _: self.replicated(), t),
        )

    def batch_sharding(self, ndim: int) -> NamedSharding:
        """Batch-major arrays: leading dim split over data x fsdp, the rest replicated."""
        return NamedSharding(self.mesh, batch_spec(ndim, self.mesh, self.rules))

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def resolver(self) -> ax.Resolver:
        return activation_resolver(self.mesh, self.rules)

    @property
    def stages(self) -> int:
        """Pipeline stages of this placement (1: not pipelined)."""
        return self.mesh.shape[STAGE_AXIS]


# XLA compile options per (platform, call kind) for a process with one device. On XLA:CPU (jaxlib
# 0.10) a YNNPACK dot fusion runs each matmul on one thread, so when one program at a time runs on the
# process's cores, a training or scoring forward, whose matmuls are large, keeps one of two cores busy
# most of the time; without YNNPACK fusions XLA's own dots use every core (small preset, 128 rows x 48
# tokens: forward 0.55 -> 0.40 s, forward + backward 1.64 -> 1.55 s; GRPO's step on 1 device 3.0 ->
# 2.7 s). A decode step's matmuls are small and run faster through YNNPACK (GRPO's generate call 0.75 s
# with it, 0.83 s without). With several devices the process already runs one program per device at
# once, and Eigen's dots then compete for the same cores (23.6M PPO on 2 devices: FSDP 13.5 -> 14.2 s,
# the planner's actor / critic split 11.2 -> 12.6 s), so those keep the defaults.
COMPILER_OPTIONS: dict[tuple[str, str], dict[str, Any]] = {
    ("cpu", "train"): {"xla_cpu_experimental_ynn_fusion_type": ""},
    ("cpu", "inference"): {"xla_cpu_experimental_ynn_fusion_type": ""},
}


def compiler_options(kind: str | None, platform: str) -> dict[str, Any]:
    """Compile options of a call of `kind` on `platform` in this process (`COMPILER_OPTIONS`)."""
    if jax.local_device_count(platform) != 1:
        return {}
    return COMPILER_OPTIONS.get((platform, kind), {})


def compile_lowered(lowered: jax.stages.Lowered, options: dict[str, Any]) -> jax.stages.Compiled:
    """Compile with `options`, or without them where this jaxlib does not know one (they only tune speed)."""
    if options:
        try:
            return lowered.compile(compiler_options=options)
        except jax.errors.JaxRuntimeError as e:
            if "No such compile option" not in str(e):
                raise
    return lowered.compile()


class PlacedFunction:
    """`fn` jitted for one placement, compiled once per argument signature; `kind` (the call's: train,
    inference, generate) picks the compile options of a process with one device (`COMPILER_OPTIONS`).

    A train call, fn(params, opt_state, inputs) -> (params, opt_state, outputs), with `out_shardings`
    None, returns its parameters and optimizer state laid out as they came in. Left to the compiler,
    the new parameters would follow the ZeRO-1 optimizer state into its split over the data-parallel
    axes (`Placed.opt_state_shardings`) and every later call would gather them.
    """

    def __init__(
        self,
        placed: Placed,
        fn: Callable,
        in_shardings: Any,
        out_shardings: Any,
        donate_argnums: Sequence[int] = (),
        kind: str | None = None,
    ):
        self.placed = placed
        self.fn = fn
        self.compiler_options = compiler_options(kind, placed.mesh.devices.flat[0].platform)

        # A function object of its own: jax.jit shares traces between jit objects of the same Python
        # function, and a trace made under another placement's activation rules (or pipeline stages)
        # must not be reused.
        def placed_fn(*args):
            return fn(*args)

        base = getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", "call")
        placed_fn.__name__ = placed_fn.__qualname__ = f"{base}@{placed.call}"
        self._placed_fn, self._in_shardings, self._donate = placed_fn, in_shardings, tuple(donate_argnums)
        self._keeps_state = kind == "train" and out_shardings is None
        self._jitted = jax.jit(
            placed_fn, in_shardings=in_shardings, out_shardings=out_shardings, donate_argnums=self._donate
        )
        self._compiled: dict[Any, jax.stages.Compiled] = {}
        self._lock = threading.Lock()

    @staticmethod
    def signature(args: tuple) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten(args)
        return treedef, tuple(
            (tuple(getattr(x, "shape", ())), str(jax.numpy.result_type(x)), bool(getattr(x, "weak_type", False)))
            for x in leaves
        )

    def compiled(self, *args: Any) -> jax.stages.Compiled:
        """The executable for these arguments' shapes (lowered with the placement's activation rules)."""
        key = self.signature(args)
        with self._lock:
            if key not in self._compiled:
                with ax.activation_sharding(self.placed.resolver()), pipeline.staged(self.placed.stages, STAGE_AXIS):
                    self._compiled[key] = compile_lowered(self._jit_for(args).lower(*args), self.compiler_options)
            return self._compiled[key]

    def _jit_for(self, args: tuple) -> Any:
        """The jitted function; for a train call, one whose params and optimizer state come out as they
        went in (the arguments' shardings: committed arrays', or abstract ones' `sharding`)."""
        if not self._keeps_state:
            return self._jitted
        kept = tuple(jax.tree_util.tree_map(lambda x: x.sharding, a) for a in args[:2])
        return jax.jit(self._placed_fn, in_shardings=self._in_shardings, out_shardings=kept + (None,),
                       donate_argnums=self._donate)

    @property
    def num_compiled(self) -> int:
        return len(self._compiled)

    def __call__(self, *args: Any) -> Any:
        """Dispatch (asynchronously) on the placement's devices."""
        return self.compiled(*args)(*args)


class CallCache:
    """Placements and compiled functions of a plan, created on first use and reused."""

    def __init__(
        self,
        plan: ExecutionPlan,
        *,
        devices: Sequence[Device] | None = None,
        rules: AxisRules | None = None,
    ):
        self.plan = plan
        self.devices = devices
        self.rules = rules or DEFAULT_RULES
        self._meshes: dict[tuple[DeviceGroup, Any], Mesh] = {}
        self._functions: dict[tuple[str, Placement, Callable], PlacedFunction] = {}

    def placed(self, call: str) -> Placed:
        if call not in self.plan.calls:
            raise PlanError(f"call {call!r} is not in the plan; planned calls: {list(self.plan.calls)}")
        p = self.plan.calls[call]
        if p.group not in self.plan.groups:
            raise PlanError(f"call {call!r} uses undefined group {p.group!r}; defined: {sorted(self.plan.groups)}")
        group = self.plan.groups[p.group]
        key = (group, p.layout)
        if key not in self._meshes:
            self._meshes[key] = make_mesh(group, p.layout, self.devices)
        return Placed(call, p, group, self._meshes[key], self.rules)

    def function(
        self,
        call: str,
        fn: Callable,
        *,
        in_shardings: Any,
        out_shardings: Any,
        donate_argnums: Sequence[int] = (),
        kind: str | None = None,
    ) -> PlacedFunction:
        """`fn` bound to `call`'s placement; the same (call, placement, fn) returns the cached one,
        whose shardings and compile options were fixed when it was first made."""
        placed = self.placed(call)
        key = (call, placed.placement, fn)
        if key not in self._functions:
            self._functions[key] = PlacedFunction(placed, fn, in_shardings, out_shardings, donate_argnums, kind)
        return self._functions[key]

    @property
    def num_compiled(self) -> int:
        return sum(f.num_compiled for f in self._functions.values())
