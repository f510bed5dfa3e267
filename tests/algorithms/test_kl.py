"""KL estimators, penalty placement and the adaptive coefficient, against hand-computed numbers."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.algorithms.kl import adaptive_kl_coef, kl_per_token, token_level_rewards

LOGP = jnp.array([[-1.0, -2.0]])
REF = jnp.array([[-1.5, -1.0]])


def test_estimators_hand_computed():
    # log r = ref - logp = [-0.5, 1.0]
    np.testing.assert_allclose(kl_per_token(LOGP, REF, kind="k1"), [[0.5, -1.0]], rtol=1e-6)
    np.testing.assert_allclose(kl_per_token(LOGP, REF, kind="k2"), [[0.125, 0.5]], rtol=1e-6)
    k3 = [[math.exp(-0.5) + 0.5 - 1.0, math.exp(1.0) - 1.0 - 1.0]]  # 0.1065307, 0.7182818
    np.testing.assert_allclose(kl_per_token(LOGP, REF, kind="k3"), k3, rtol=1e-6)
    np.testing.assert_allclose(kl_per_token(LOGP, REF, kind="low_var_kl"), k3, rtol=1e-6)
    np.testing.assert_allclose(kl_per_token(LOGP, REF, jnp.array([[1, 0]]), kind="k1"), [[0.5, 0.0]])


def test_unknown_estimator_suggests_closest():
    with pytest.raises(ValueError, match=r"unknown KL estimator 'low_var'.*Did you mean 'low_var_kl'.*Known: \["):
        kl_per_token(LOGP, REF, kind="low_var")


def test_token_level_rewards_places_score_on_last_token():
    scores = jnp.array([2.0, -1.0])
    mask = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0]])
    kl = jnp.array([[0.1, 0.2, 0.3, 9.0], [0.5, -0.5, 9.0, 9.0]])
    expected = [
        [-0.01, -0.02, 2.0 - 0.03, 0.0],
        [-0.05, -1.0 + 0.05, 0.0, 0.0],
    ]
    out = jax.jit(token_level_rewards)(scores, mask, kl, 0.1)
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(token_level_rewards(scores, mask), [[0, 0, 2, 0], [0, -1, 0, 0]])


def test_adaptive_coefficient():
    # kl 12: error clip(12/6 - 1) = 0.2 -> 0.1 * (1 + 0.2 * 10 / 100) = 0.102
    np.testing.assert_allclose(adaptive_kl_coef(0.1, 12.0, 10, target=6.0, horizon=100.0), 0.102, rtol=1e-9)
    # kl 5.4: error -0.1 -> 0.1 * (1 - 0.1 * 10 / 100) = 0.099
    np.testing.assert_allclose(adaptive_kl_coef(0.1, 5.4, 10, target=6.0, horizon=100.0), 0.099, rtol=1e-9)
    # kl 0: error clipped to -0.2 -> 0.1 * (1 - 0.2 * 50 / 100) = 0.09
    np.testing.assert_allclose(adaptive_kl_coef(0.1, 0.0, 50, target=6.0, horizon=100.0), 0.09, rtol=1e-9)
    # two steps compose
    two = adaptive_kl_coef(adaptive_kl_coef(0.1, 12.0, 10, 6.0, 100.0), 12.0, 10, 6.0, 100.0)
    np.testing.assert_allclose(two, 0.1 * 1.02 * 1.02, rtol=1e-9)
    with pytest.raises(ValueError, match="target > 0"):
        adaptive_kl_coef(0.1, 1.0, 10, target=0.0, horizon=100.0)
