"""Masked statistics and value-normalisation state, against hand-computed numbers."""

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrlhf.algorithms.stats import (
    RunningMoments,
    last_token_onehot,
    masked_max,
    masked_mean,
    masked_var,
    masked_whiten,
)

X = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = jnp.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])  # masked-in values: 1, 2, 4


def test_masked_mean_and_var():
    # mean of {1, 2, 4} = 7/3; squared deviations 16/9 + 1/9 + 25/9 = 42/9
    np.testing.assert_allclose(masked_mean(X, MASK), 7 / 3, rtol=1e-6)
    np.testing.assert_allclose(masked_var(X, MASK), 42 / 9 / 3, rtol=1e-6)
    np.testing.assert_allclose(masked_var(X, MASK, unbiased=True), 42 / 9 / 2, rtol=1e-6)
    np.testing.assert_allclose(masked_mean(X, MASK, axis=-1), [1.5, 4.0], rtol=1e-6)
    # bool masks work the same, and an empty mask gives 0 rather than NaN
    np.testing.assert_allclose(masked_mean(X, MASK.astype(bool)), 7 / 3, rtol=1e-6)
    assert float(masked_mean(X, jnp.zeros_like(X))) == 0.0
    assert float(masked_max(X, MASK)) == 4.0


def test_masked_whiten():
    s = math.sqrt(14)  # (x - 7/3) / sqrt(14/9) = 3 (x - 7/3) / sqrt(14)
    expected = np.array([[-4 / s, -1 / s, 0.0], [5 / s, 0.0, 0.0]])
    out = masked_whiten(X, MASK, eps=0.0)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    kept = masked_whiten(X, MASK, shift_mean=False, eps=0.0)
    np.testing.assert_allclose(kept, (expected + 7 / 3) * np.asarray(MASK), rtol=1e-5, atol=1e-6)
    jitted = jax.jit(masked_whiten, static_argnames="shift_mean")(X, MASK, eps=0.0)
    np.testing.assert_allclose(jitted, expected, rtol=1e-5, atol=1e-6)


def test_whiten_is_global_over_a_sharded_batch(devices):
    """Each device holds one row; the statistics must still be those of the whole batch."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 5)).astype(np.float32) + np.arange(8, dtype=np.float32)[:, None]
    mask = (rng.random((8, 5)) < 0.7).astype(np.float32)
    mask[:, 0] = 1.0
    mesh = Mesh(np.array(devices), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    sharding = NamedSharding(mesh, P("data", None))
    out = jax.jit(masked_whiten)(jax.device_put(x, sharding), jax.device_put(mask, sharding))
    vals = x[mask > 0]
    expected = (x - vals.mean()) / np.sqrt(vals.var() + 1e-8) * mask
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-4, atol=1e-5)


def test_last_token_onehot():
    mask = jnp.array([[1, 1, 0], [0, 0, 0], [1, 1, 1]])
    np.testing.assert_array_equal(last_token_onehot(mask), [[0, 1, 0], [0, 0, 0], [0, 0, 1]])


def test_running_moments_hand_computed():
    state = RunningMoments.create(beta=0.5)
    # before any batch: identity normalisation (mean 0, var 1)
    assert float(state.mean) == 0.0 and float(state.var) == 1.0
    # batch 1: {1, 3}: mean 2, mean-square 5 -> acc 1, 2.5, debias 0.5 -> mean 2, var 1
    state = state.update(jnp.array([[1.0, 3.0, 100.0]]), jnp.array([[1, 1, 0]]))
    np.testing.assert_allclose([state.mean, state.var], [2.0, 1.0], rtol=1e-6)
    # batch 2: {5}: acc 0.5*1 + 0.5*5 = 3, 0.5*2.5 + 0.5*25 = 13.75, debias 0.75
    # -> mean 4, mean-square 55/3, var 55/3 - 16 = 7/3
    state = jax.jit(lambda s, x, m: s.update(x, m))(state, jnp.array([[5.0, 0.0, 0.0]]), jnp.array([[1, 0, 0]]))
    np.testing.assert_allclose([state.mean, state.var], [4.0, 7 / 3], rtol=1e-5)
    np.testing.assert_allclose(state.std, math.sqrt(7 / 3 + 1e-5), rtol=1e-5)
    v = jnp.array([1.0, 4.0, 10.0])
    np.testing.assert_allclose(state.denormalize(state.normalize(v)), v, rtol=1e-5)
    assert state.beta == 0.5 and len(jax.tree_util.tree_leaves(state)) == 3
