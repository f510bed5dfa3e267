"""Optimizers for trained roles: AdamW with warmup + decay, gradient clipping,
a non-finite guard that leaves parameters and optimizer state untouched, and
`only_trainable`, which restricts an optimizer to part of the parameters (LoRA)."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxrlhf.registry import Registry

SCHEDULES: Registry[Callable[[float, int, int], optax.Schedule]] = Registry("lr schedule", entries={
    "constant": lambda lr, warmup, total: optax.join_schedules(
        [optax.linear_schedule(0.0, lr, max(warmup, 1)), optax.constant_schedule(lr)], [max(warmup, 1)]
    ) if warmup > 0 else optax.constant_schedule(lr),
    "cosine": lambda lr, warmup, total: optax.warmup_cosine_decay_schedule(
        0.0 if warmup > 0 else lr, lr, warmup, max(total, warmup + 1), end_value=0.1 * lr
    ),
    "linear": lambda lr, warmup, total: optax.join_schedules(
        [optax.linear_schedule(0.0 if warmup > 0 else lr, lr, max(warmup, 1)),
         optax.linear_schedule(lr, 0.1 * lr, max(total - warmup, 1))],
        [max(warmup, 1)],
    ),
})


def build_optimizer(
    *,
    lr: float,
    total_updates: int,
    weight_decay: float = 0.0,
    b1: float = 0.9,
    b2: float = 0.95,
    eps: float = 1e-8,
    warmup_steps: int = 0,
    schedule: str = "constant",
    max_grad_norm: float | None = 1.0,
    master_weights: bool = False,
    trainable: Callable[[tuple], bool] | None = None,
) -> optax.GradientTransformation:
    """AdamW with a learning-rate schedule over `total_updates` optimizer updates.

    `master_weights`: keep an fp32 master copy (for bf16 parameters; see `with_fp32_master`).
    `trainable(path)`: update only the parameters it accepts (LoRA; see `only_trainable`).
    """
    sched = SCHEDULES.get(schedule)(lr, warmup_steps, total_updates)
    parts = [optax.clip_by_global_norm(max_grad_norm)] if max_grad_norm else []
    parts.append(optax.adamw(sched, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay))
    chain = optax.chain(*parts)
    chain = with_fp32_master(chain) if master_weights else chain
    return chain if trainable is None else only_trainable(chain, trainable)


class MasterWeightsState(NamedTuple):
    """fp32 master copy of low-precision parameters, and the inner optimizer's state over it."""

    master: Any
    inner: Any


def with_fp32_master(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """Mixed precision: `inner` updates an fp32 master copy; the (bf16) parameters follow it.

    Small updates that would vanish in bf16 (an lr of 1e-6 on weights near 1
    is below bf16's resolution) accumulate in the master, and the returned
    updates take each parameter exactly to its master rounded to the
    parameter's dtype. Optimizer state (moments) lives in fp32 over the master.
    """

    def init(params):
        master = jax.tree_util.tree_map(lambda p: jnp.asarray(p, jnp.float32), params)
        return MasterWeightsState(master, inner.init(master))

    def update(grads, state, params=None):
        grads = jax.tree_util.tree_map(lambda g: g.astype(jnp.float32), grads)
        updates, inner_state = inner.update(grads, state.inner, state.master)
        master = optax.apply_updates(state.master, updates)
        # p + (round(m) - p) in fp32 is round(m) exactly: both are representable in the param dtype
        to_params = jax.tree_util.tree_map(
            lambda m, p: m.astype(p.dtype).astype(jnp.float32) - p.astype(jnp.float32), master, params
        )
        return to_params, MasterWeightsState(master, inner_state)

    return optax.GradientTransformation(init, update)


def guarded_update(
    optimizer: optax.GradientTransformation,
    grads: Any,
    opt_state: Any,
    params: Any,
    loss: jax.Array,
    enabled: jax.Array | bool = True,
) -> tuple[Any, Any, jax.Array, jax.Array]:
    """Apply one update unless the loss or the gradient is non-finite (or `enabled` is False).

    Returns (params, opt_state, finite, grad_norm): when the update is not applied both trees come
    back unchanged, so the run continues from consistent state. The check reads the gradient once:
    its global norm is finite exactly when every entry is, except that an entry whose square
    overflows (|g| > ~1.8e19 in float32) also counts as non-finite, as in torch's
    `clip_grad_norm_(error_if_nonfinite=True)`. A skipped update runs nothing (`lax.cond`) rather
    than computing an update and selecting the old trees: on CPU those extra passes over the
    parameters and both Adam moments doubled the cost of an update.
    """
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

    def apply(state: tuple[Any, Any]) -> tuple[Any, Any]:
        params, opt_state = state
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_opt_state

    params, opt_state = jax.lax.cond(finite & enabled, apply, lambda state: state, (params, opt_state))
    return params, opt_state, finite, grad_norm


class PartialOptimizer(NamedTuple):
    """An optimizer over the parameters whose path `trainable` accepts; the others are frozen.

    `init` takes the whole parameter tree but keeps state only for the trainable part, and
    `update` sees only that part (`minibatch_updates` differentiates it alone), so frozen
    parameters have no gradient, no moments and no master copy. Duck-types an optax
    `GradientTransformation`; `trainable_params` is what `Placed.opt_state_shardings` lays out.
    """

    init: Callable[[Any], Any]
    update: Callable[..., Any]
    trainable: Callable[[tuple], bool]

    def split(self, params: nnx.State) -> tuple[nnx.State, nnx.State]:
        """(trainable, frozen) parts of `params`; the leaves are shared, not copied."""
        return _split(params, self.trainable)

    def trainable_params(self, params: Any) -> Any:
        """The trainable part of a parameter tree (anything else, e.g. optax's placeholder, as is)."""
        return _split(params, self.trainable)[0] if isinstance(params, nnx.State) else params

    @staticmethod
    def join(trainable: nnx.State, frozen: nnx.State) -> nnx.State:
        return nnx.merge_state(frozen, trainable)


def _split(params: nnx.State, trainable: Callable[[tuple], bool]) -> tuple[nnx.State, nnx.State]:
    flat = nnx.to_flat_state(params)
    return (nnx.from_flat_state([(p, v) for p, v in flat if trainable(tuple(p))]),
            nnx.from_flat_state([(p, v) for p, v in flat if not trainable(tuple(p))]))


def only_trainable(inner: optax.GradientTransformation, trainable: Callable[[tuple], bool]) -> PartialOptimizer:
    """`inner` applied to the parameters `trainable(path)` selects (LoRA adapters, a scalar head)."""

    def init(params: Any) -> Any:
        return inner.init(_split(params, trainable)[0] if isinstance(params, nnx.State) else params)

    return PartialOptimizer(init, inner.update, trainable)


def split_trainable(optimizer: Any, params: Any) -> tuple[Any, Any]:
    """(what `optimizer` updates, the frozen rest or None): all of `params` for a plain optimizer."""
    if isinstance(optimizer, PartialOptimizer):
        return optimizer.split(params)
    return params, None


def join_trainable(trainable: Any, frozen: Any) -> Any:
    """Inverse of `split_trainable`."""
    return trainable if frozen is None else PartialOptimizer.join(trainable, frozen)
