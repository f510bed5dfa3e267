"""GPipe pipeline parallelism over the stacked decoder layers.

With S pipeline stages the stacked layer parameters ([layers, ...], the
"layers" logical axis sharded over the stage mesh axis) are viewed as
[S, layers / S, ...]: stage s owns the consecutive block of layers
[s * L/S, (s + 1) * L/S). A batch is split into M micro-batches (strided
rows, as `jaxrlhf.algorithms.update` splits them, so rows stay evenly split
over the data axes) and run in M + S - 1 iterations. In iteration i:

    stage 0 takes micro-batch min(i, M - 1) (embedded tokens);
    every stage s runs its block on the activation it holds, which belongs
    to micro-batch i - s (a `vmap` over the stage dimension; with
    `spmd_axis_name` the compiler gives each stage's devices their own block);
    the last stage's output is micro-batch i - (S - 1)'s final activation;
    the activations shift one stage on (`jnp.roll` of the stage-sharded
    [S, rows, length, embed] array: a collective permute between stages).

Stages outside 0 <= i - s < M compute on stale values whose outputs are
never read (the pipeline bubble), so the result is the unpipelined one;
backward is autodiff of the loop. Memory: autodiff keeps what the layer body
saves (per its remat policy) for all M + S - 1 iterations, i.e. every
micro-batch's activations at once, as GPipe does; the embedded input and the
re-assembled output are whole-batch arrays replicated over stages.

`models/` knows no meshes: the placement declares the number of stages (and
the mesh axis name) with `staged(...)` while tracing, and the caller that
splits a batch into micro-batches declares M with `microbatches(k)`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jaxrlhf.models import axes as ax


@dataclasses.dataclass(frozen=True)
class Stages:
    """How many pipeline stages the traced call has, and the mesh axis they live on (None: no mesh)."""

    count: int = 1
    axis: str | None = None


_stages: contextvars.ContextVar[Stages] = contextvars.ContextVar("pipeline_stages", default=Stages())
_microbatches: contextvars.ContextVar[int] = contextvars.ContextVar("pipeline_microbatches", default=1)


@contextlib.contextmanager
def staged(count: int, axis: str | None = None) -> Iterator[None]:
    """Trace the model forward inside this block as a `count`-stage pipeline over mesh axis `axis`."""
    token = _stages.set(Stages(int(count), axis))
    try:
        yield
    finally:
        _stages.reset(token)


@contextlib.contextmanager
def microbatches(k: int) -> Iterator[None]:
    """Pipelined forwards inside this block split their batch into `k` micro-batches."""
    token = _microbatches.set(int(k))
    try:
        yield
    finally:
        _microbatches.reset(token)


def current_stages() -> Stages:
    return _stages.get()


def is_pipelined() -> bool:
    return _stages.get().count > 1


def current_microbatches() -> int:
    return _microbatches.get()


def split_rows(tree: Any, k: int) -> Any:
    """[B, ...] -> [k, B / k, ...], micro-batch j holding rows j, j + k, ... (strided)."""
    return jax.tree_util.tree_map(lambda x: jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1), tree)


def merge_rows(tree: Any) -> Any:
    """The inverse of `split_rows`."""
    return jax.tree_util.tree_map(lambda x: jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:]), tree)


LayerFn = Callable[[Any, jax.Array, Any], jax.Array]  # (one layer's state, x [rows, length, embed], row inputs) -> x


def gpipe(
    layer: LayerFn,
    layer_states: Any,
    x: Float[Array, "batch length embed"],
    rows: Any,
    *,
    stages: Stages,
    microbatches: int,
) -> Float[Array, "batch length embed"]:
    """The stacked layers applied to `x` as a GPipe schedule (see the module docstring).

    `layer_states` has a leading [layers] dimension; `rows` is a pytree of per-row inputs
    ([batch, ...]: positions, key mask, segment ids) that every layer of a micro-batch reads.
    """
    s, m = stages.count, max(int(microbatches), 1)
    num_layers = jax.tree_util.tree_leaves(layer_states)[0].shape[0]
    if num_layers % s:
        raise ValueError(f"{num_layers} decoder layers do not split into {s} equal pipeline stages")
    if x.shape[0] % m:
        raise ValueError(f"a batch of {x.shape[0]} rows does not split into {m} pipeline micro-batches")
    blocks = jax.tree_util.tree_map(lambda p: p.reshape(s, num_layers // s, *p.shape[1:]), layer_states)
    xs = ax.constrain(split_rows(x, m), (None, ax.BATCH, ax.LENGTH, ax.EMBED))
    rows_mb = split_rows(rows, m)
    stage_ids = jnp.arange(s)

    def run_block(block: Any, h: jax.Array, block_rows: Any) -> jax.Array:
        h, _ = jax.lax.scan(lambda h, layer_state: (layer(layer_state, h, block_rows), None), h, block)
        return h

    run_stages = jax.vmap(run_block, spmd_axis_name=stages.axis)

    def per_stage(h: jax.Array) -> jax.Array:
        return ax.constrain(h, (ax.STAGE, ax.BATCH, ax.LENGTH, ax.EMBED))

    def iteration(state: jax.Array, i: jax.Array) -> tuple[jax.Array, jax.Array]:
        first = per_stage(jnp.where((stage_ids == 0)[:, None, None, None], xs[jnp.minimum(i, m - 1)][None], state))
        mb = jnp.clip(i - stage_ids, 0, m - 1)  # the micro-batch each stage works on
        stage_rows = jax.tree_util.tree_map(
            lambda r: ax.constrain(r[mb], (ax.STAGE, ax.BATCH) + (None,) * (r.ndim - 2)), rows_mb
        )
        out = run_stages(blocks, first, stage_rows)
        return per_stage(jnp.roll(out, 1, axis=0)), ax.constrain(out[-1], (ax.BATCH, ax.LENGTH, ax.EMBED))

    state = per_stage(jnp.zeros((s, *xs.shape[1:]), x.dtype))
    _, last = jax.lax.scan(iteration, state, jnp.arange(m + s - 1))
    return merge_rows(last[s - 1:])
