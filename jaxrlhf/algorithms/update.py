"""The optimizer loop every train call shares: epochs x minibatches as one `lax.scan`.

One optimizer update per minibatch. An update is skipped (parameters and
optimizer state unchanged) when its loss or gradients are non-finite; a loss
may also report that the minibatch is too far off-policy (PPO's importance
ratio early stop), after which every later update of the call is skipped.
Both are counted in the returned stats (`skipped_nonfinite`, `skipped_ratio`).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Int

from jaxrlhf.algorithms.optim import guarded_update

# loss_fn(params, minibatch) -> (loss, (stats dict, stop flag))
LossFn = Callable[[Any, Any], tuple[jax.Array, tuple[dict[str, jax.Array], jax.Array]]]

SUMMED_STATS = ("skipped_nonfinite", "skipped_ratio")


def minibatch_indices(rng: jax.Array, batch: int, minibatches: int, epochs: int) -> Int[Array, "updates size"]:
    """Row indices of every minibatch of every epoch: [epochs * minibatches, batch / minibatches]."""
    size = batch // minibatches
    if minibatches == 1 and epochs == 1:
        return jnp.arange(batch)[None]
    perms = [jax.random.permutation(k, batch) for k in jax.random.split(rng, epochs)]
    return jnp.concatenate(perms).reshape(epochs * minibatches, size)


def take_rows(tree: Any, idx: jax.Array) -> Any:
    return jax.tree_util.tree_map(lambda x: jnp.take(x, idx, axis=0), tree)


def minibatch_updates(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    params: Any,
    opt_state: Any,
    data: Any,
    rng: jax.Array,
    *,
    minibatches: int = 1,
    epochs: int = 1,
    early_stop: bool = False,
) -> tuple[Any, Any, dict[str, jax.Array]]:
    """Run the updates; stats are averaged over updates except the skip counters (summed).

    With `early_stop` the stop flag a loss returns skips that update and every later one.
    """
    batch = jax.tree_util.tree_leaves(data)[0].shape[0]
    if batch % minibatches:
        raise ValueError(f"batch of {batch} rows does not split into {minibatches} minibatches")
    idx = minibatch_indices(rng, batch, minibatches, epochs)

    def one(carry, rows):
        params, opt_state, stopped = carry
        mb = take_rows(data, rows)
        (loss, (stats, stop)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, mb)
        if early_stop:
            stopped = stopped | stop
        params, opt_state, finite = guarded_update(optimizer, grads, opt_state, params, loss, ~stopped)
        stats = dict(stats)
        stats["grad_norm"] = optax.global_norm(grads)
        stats["skipped_nonfinite"] = (~finite).astype(jnp.float32)
        stats["skipped_ratio"] = stopped.astype(jnp.float32)
        return (params, opt_state, stopped), stats

    (params, opt_state, _), stats = jax.lax.scan(one, (params, opt_state, jnp.array(False)), idx)
    stats = {k: (jnp.sum(v) if k in SUMMED_STATS else jnp.mean(v)) for k, v in stats.items()}
    return params, opt_state, stats
