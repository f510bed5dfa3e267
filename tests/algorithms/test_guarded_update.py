"""The non-finite guard: a finite update is exactly optax's, a skipped one changes nothing, and the
gradient norm it reports is optax's global norm (the guard reads the gradient once for both)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrlhf.algorithms.optim import build_optimizer, guarded_update


def _tree():
    rng = np.random.RandomState(0)
    params = {"w": jnp.asarray(rng.randn(4, 3), jnp.float32), "b": jnp.asarray(rng.randn(3), jnp.float32)}
    grads = {"w": jnp.asarray(rng.randn(4, 3), jnp.float32), "b": jnp.asarray(rng.randn(3), jnp.float32)}
    return params, grads


def _equal(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def test_a_finite_update_is_optax_update_and_reports_the_global_norm():
    params, grads = _tree()
    opt = build_optimizer(lr=1e-2, total_updates=10, max_grad_norm=1.0)
    state = opt.init(params)
    new_params, new_state, finite, norm = jax.jit(guarded_update, static_argnums=0)(
        opt, grads, state, params, jnp.float32(0.5))
    updates, want_state = opt.update(grads, state, params)
    np.testing.assert_allclose(norm, optax.tree.norm(grads), rtol=1e-6)
    assert bool(finite)
    for got, want in zip(jax.tree_util.tree_leaves((new_params, new_state)),
                         jax.tree_util.tree_leaves((optax.apply_updates(params, updates), want_state))):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bad", ["nan_grad", "inf_grad", "huge_grad", "nan_loss", "disabled"])
def test_a_skipped_update_leaves_parameters_and_state_unchanged(bad):
    params, grads = _tree()
    opt = build_optimizer(lr=1e-2, total_updates=10, max_grad_norm=1.0)
    state = opt.init(params)
    loss, enabled = jnp.float32(0.5), True
    if bad == "nan_grad":
        grads["w"] = grads["w"].at[1, 2].set(jnp.nan)
    elif bad == "inf_grad":
        grads["b"] = grads["b"].at[0].set(-jnp.inf)
    elif bad == "huge_grad":  # finite, but its square overflows float32: counted as non-finite
        grads["b"] = grads["b"].at[0].set(3e19)
    elif bad == "nan_loss":
        loss = jnp.float32(jnp.nan)
    else:
        enabled = jnp.array(False)
    new_params, new_state, finite, _ = jax.jit(guarded_update, static_argnums=0)(
        opt, grads, state, params, loss, enabled)
    assert _equal(new_params, params) and _equal(new_state, state)
    assert bool(finite) == (bad == "disabled")
