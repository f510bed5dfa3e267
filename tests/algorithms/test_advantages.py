"""Advantage estimators against hand-computed numbers and a plain Python loop."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageBatch,
    compute_advantages,
    gae,
    get_advantage,
    register_advantage,
)

# Row 0 fills the response; row 1 has 2 tokens (column 2 is padding holding junk that must be
# ignored, including the critic's value 9.0 there: whether row 1 ended with EOS or was cut at the
# length limit, nothing after its last token is read).
REWARDS = jnp.array([[0.0, 0.0, 1.0], [0.1, 0.2, 5.0]])
VALUES = jnp.array([[0.5, 0.6, 0.7], [1.0, 0.5, 9.0]])
MASK = jnp.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def test_gae_hand_computed_no_bootstrap_after_the_last_token():
    """V after the last response token is 0 for every row, truncated or not: that slot is never a value
    target, so it would be an untrained number (TRL and verl end responses the same way)."""
    # gamma 0.9, lam 0.8, gamma*lam = 0.72
    # row 0: next V = [0.6, 0.7, 0]
    #   d = [0 + .9*.6 - .5, 0 + .9*.7 - .6, 1 - .7] = [0.04, 0.03, 0.3]
    #   A2 = 0.3; A1 = 0.03 + .72*.3 = 0.246; A0 = 0.04 + .72*.246 = 0.21712
    # row 1: next V = [0.5, 0]
    #   d = [0.1 + .9*.5 - 1.0, 0.2 + 0 - .5] = [-0.45, -0.3]
    #   A1 = -0.3; A0 = -0.45 + .72*-0.3 = -0.666
    batch = AdvantageBatch(rewards=REWARDS, mask=MASK, values=VALUES)
    adv, ret = jax.jit(partial(gae, gamma=0.9, lam=0.8))(batch)
    np.testing.assert_allclose(adv, [[0.21712, 0.246, 0.3], [-0.666, -0.3, 0.0]], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ret, [[0.71712, 0.846, 1.0], [0.334, 0.2, 0.0]], rtol=1e-5, atol=1e-6)


def test_gae_default_gamma_lambda_one_is_return_minus_value():
    # gamma = lam = 1: A_t = (sum of rewards from t) - V_t
    batch = AdvantageBatch(rewards=REWARDS, mask=MASK, values=VALUES)
    adv, ret = compute_advantages("gae", batch)
    np.testing.assert_allclose(adv, [[0.5, 0.4, 0.3], [0.3 - 1.0, 0.2 - 0.5, 0.0]], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ret, [[1.0, 1.0, 1.0], [0.3, 0.2, 0.0]], rtol=1e-5, atol=1e-6)


def _gae_loop(rewards, values, lengths, gamma, lam):
    """Textbook GAE, one sequence at a time, in plain Python (V = 0 after the last token)."""
    adv = np.zeros_like(rewards)
    for b, n in enumerate(lengths):
        last = 0.0
        for t in reversed(range(n)):
            next_v = values[b, t + 1] if t + 1 < n else 0.0
            delta = rewards[b, t] + gamma * next_v - values[b, t]
            last = delta + gamma * lam * last
            adv[b, t] = last
    return adv


def test_gae_matches_python_loop_on_random_batch():
    rng = np.random.default_rng(1)
    b, t = 6, 9
    rewards = rng.normal(size=(b, t)).astype(np.float32)
    values = rng.normal(size=(b, t)).astype(np.float32)
    lengths = [9, 1, 4, 9, 7, 0]
    mask = (np.arange(t)[None, :] < np.array(lengths)[:, None]).astype(np.float32)
    batch = AdvantageBatch(rewards=jnp.asarray(rewards), mask=jnp.asarray(mask), values=jnp.asarray(values))
    adv, ret = gae(batch, gamma=0.95, lam=0.9)
    expected = _gae_loop(rewards, values, lengths, 0.95, 0.9)
    np.testing.assert_allclose(adv, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret, (expected + values) * mask, rtol=1e-5, atol=1e-5)


def _outcome_batch(seq_rewards, t=3):
    """Token rewards whose per-sequence sums are `seq_rewards` (split over two tokens to test the sum)."""
    r = np.zeros((len(seq_rewards), t), np.float32)
    r[:, 0] = 0.25
    r[:, 1] = np.asarray(seq_rewards) - 0.25
    r[:, 2] = 7.0  # padding: outside the mask below
    mask = np.array([[1, 1, 0]] * len(seq_rewards), np.float32)
    return AdvantageBatch(rewards=jnp.asarray(r), mask=jnp.asarray(mask))


def test_grpo_group_normalised():
    # group 1: r = [1, 2, 3], mean 2, unbiased std 1 -> [-1, 0, 1]; group 2: all equal -> 0, not NaN
    batch = _outcome_batch([1.0, 2.0, 3.0, 5.0, 5.0, 5.0])
    adv, ret = jax.jit(partial(get_advantage("grpo"), group_size=3))(batch)
    expected = np.array([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0]) / (1.0 + 1e-6)
    np.testing.assert_allclose(adv[:, 0], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(adv[:, 1], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(adv[:, 2], 0.0)
    np.testing.assert_array_equal(adv, ret)
    # binary rewards, all right or all wrong: exactly 0 (float32 rounding must not be blown up by 1/eps)
    flat, _ = compute_advantages("grpo", _outcome_batch([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.1, 0.1, 0.1]), group_size=3)
    assert np.all(np.asarray(flat) == 0.0)
    # Dr. GRPO: mean baseline only
    adv, _ = compute_advantages("grpo", batch, group_size=3, scale_by_std=False)
    np.testing.assert_allclose(adv[:, 0], [-1.0, 0.0, 1.0, 0.0, 0.0, 0.0], atol=1e-6)


def test_rloo_leave_one_out():
    # r = [1, 2, 6]: baselines (2+6)/2 = 4, (1+6)/2 = 3.5, (1+2)/2 = 1.5 -> [-3, -1.5, 4.5]
    adv, _ = compute_advantages("rloo", _outcome_batch([1.0, 2.0, 6.0, 0.0, 0.0, 3.0]), group_size=3)
    np.testing.assert_allclose(adv[:, 0], [-3.0, -1.5, 4.5, -1.5, -1.5, 3.0], rtol=1e-6)
    np.testing.assert_array_equal(adv[:, 2], 0.0)


def test_remax_greedy_baseline():
    # Token rewards [0.25, r - 0.25]: returns-to-go [r, r - 0.25], minus the greedy reward 0.5 (verl's form).
    batch = _outcome_batch([1.0, 0.0]).replace(baseline_rewards=jnp.array([0.5, 0.5]))
    adv, _ = compute_advantages("remax", batch)
    np.testing.assert_allclose(adv[:, :2], [[0.5, 0.25], [-0.5, -0.75]], rtol=1e-6)
    np.testing.assert_array_equal(adv[:, 2], 0.0)
    # With the whole reward on the last token (no KL), it is simply r - r_greedy on every token.
    last = AdvantageBatch(rewards=jnp.array([[0.0, 1.0]]), mask=jnp.ones((1, 2)), baseline_rewards=jnp.array([1.0]))
    np.testing.assert_allclose(compute_advantages("remax", last)[0], [[0.0, 0.0]])


def test_reinforce_pp_normalises_returns_over_the_batch():
    # Returns-to-go (gamma 1) of the masked tokens: row 0 [1.0, 0.75], row 1 [0.0, -0.25] (padding excluded).
    batch = _outcome_batch([1.0, 0.0])
    adv, returns = compute_advantages("reinforce_pp", batch)
    np.testing.assert_allclose(returns[:, :2], [[1.0, 0.75], [0.0, -0.25]], rtol=1e-6)
    g = np.array([1.0, 0.75, 0.0, -0.25])
    expected = (g - g.mean()) / np.sqrt(g.var() + 1e-8)  # population variance over the batch's tokens
    np.testing.assert_allclose(adv[:, :2].reshape(-1), expected, rtol=1e-5)
    np.testing.assert_array_equal(adv[:, 2], 0.0)
    # gamma discounts later rewards: row 0 token 0 = 0.25 + 0.5 * 0.75
    _, disc = compute_advantages("reinforce_pp", batch, gamma=0.5)
    np.testing.assert_allclose(disc[0, 0], 0.25 + 0.5 * 0.75, rtol=1e-6)


def test_missing_inputs_and_bad_groups_are_clear_errors():
    with pytest.raises(ValueError, match="needs batch.values"):
        compute_advantages("gae", _outcome_batch([1.0]))
    with pytest.raises(ValueError, match="baseline_rewards"):
        compute_advantages("remax", _outcome_batch([1.0]))
    with pytest.raises(ValueError, match="not a whole number of groups"):
        compute_advantages("grpo", _outcome_batch([1.0, 2.0, 3.0]), group_size=2)
    with pytest.raises(ValueError, match="group_size >= 2"):
        compute_advantages("rloo", _outcome_batch([1.0, 2.0]), group_size=1)


def test_registry_rejects_unknown_names_and_duplicates():
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'gea'\. Did you mean 'gae'\?") as err:
        get_advantage("gea")
    for name in ("gae", "grpo", "rloo", "remax", "reinforce_pp"):
        assert name in str(err.value)
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("gae")(lambda batch: (batch.rewards, batch.rewards))
    assert set(ADVANTAGE_ESTIMATORS) >= {"gae", "grpo", "rloo", "remax", "reinforce_pp"}
    # Whitening is declared by each estimator: optional for GAE, never for group baselines.
    assert get_advantage("gae").whitening == "optional" and get_advantage("gae").needs_critic
    assert get_advantage("grpo").whitening == get_advantage("rloo").whitening == "never"
    assert get_advantage("reinforce_pp").whitening == "always"
