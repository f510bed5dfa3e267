"""Policy and value losses against hand-computed numbers."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.algorithms.losses import (
    POLICY_LOSSES,
    aggregate,
    get_loss,
    importance_ratio_exploded,
    ppo_policy_loss,
    value_loss,
)

# One row, three response tokens and one pad. Ratios 1.1 (inside the clip), 1.5 with A > 0
# (clipped at 1.2) and 0.5 with A < 0 (clipped at 0.8); the pad has a huge ratio to ignore.
OLD = jnp.zeros((1, 4))
LOGP = jnp.log(jnp.array([[1.1, 1.5, 0.5, 3.0]]))
ADV = jnp.array([[1.0, 1.0, -2.0, 100.0]])
MASK = jnp.array([[1.0, 1.0, 1.0, 0.0]])


def test_ppo_clipped_loss_inside_and_outside_clip():
    # per token max(-A r, -A clip(r, 0.8, 1.2)):
    #   t0: max(-1.1, -1.1) = -1.1   (inside)
    #   t1: max(-1.5, -1.2) = -1.2   (clipped)
    #   t2: max( 1.0,  1.6) =  1.6   (clipped)
    loss, stats = jax.jit(ppo_policy_loss)(LOGP, OLD, ADV, MASK)
    np.testing.assert_allclose(loss, (-1.1 - 1.2 + 1.6) / 3, rtol=1e-5)
    np.testing.assert_allclose(stats["clipfrac"], 2 / 3, rtol=1e-6)
    np.testing.assert_allclose(stats["ratio/mean"], (1.1 + 1.5 + 0.5) / 3, rtol=1e-5)
    np.testing.assert_allclose(stats["ratio/max"], 1.5, rtol=1e-5)
    approx_kl = sum(r - 1 - math.log(r) for r in (1.1, 1.5, 0.5)) / 3  # k3 estimate, 0.0974573
    np.testing.assert_allclose(stats["approx_kl"], approx_kl, rtol=1e-4)
    np.testing.assert_allclose(stats["loss/policy"], loss)
    assert "entropy" not in stats


def test_ppo_gradient_is_zero_on_clipped_tokens():
    grad = jax.grad(lambda lp: ppo_policy_loss(lp, OLD, ADV, MASK)[0])(LOGP)
    # d/dlogp of -A r / 3 = -A r / 3 on the unclipped token; 0 where clipped or padded
    np.testing.assert_allclose(grad, [[-1.1 / 3, 0.0, 0.0, 0.0]], rtol=1e-5, atol=1e-7)


def test_ppo_dual_clip_and_entropy():
    # A = -1, r = 5: standard loss max(5, 1.2) = 5; dual clip caps at -A * 3 = 3
    logp, old, adv, mask = jnp.log(jnp.array([[5.0]])), jnp.zeros((1, 1)), jnp.array([[-1.0]]), jnp.ones((1, 1))
    plain, _ = ppo_policy_loss(logp, old, adv, mask)
    capped, stats = ppo_policy_loss(logp, old, adv, mask, dual_clip=3.0)
    np.testing.assert_allclose([plain, capped, stats["dual_clipfrac"]], [5.0, 3.0, 1.0], rtol=1e-5)
    # entropy bonus: loss - coef * mean entropy over masked tokens
    ent = jnp.array([[2.0, 4.0, 6.0, 100.0]])
    loss, stats = ppo_policy_loss(LOGP, OLD, ADV, MASK, entropy=ent, entropy_coef=0.01)
    np.testing.assert_allclose(stats["entropy"], 4.0, rtol=1e-6)
    np.testing.assert_allclose(loss, (-1.1 - 1.2 + 1.6) / 3 - 0.04, rtol=1e-5)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        ppo_policy_loss(logp, old, adv, mask, dual_clip=0.5)


def test_grpo_loss_sequence_mean_and_kl_in_loss():
    # ratio 1 everywhere, so the per-token loss is -A.
    # rows: [2] and [1, 2]: seq-mean-token-mean = mean(-2, -1.5) = -1.75; token-mean = -5/3
    logp = jnp.full((2, 2), -1.0)
    adv = jnp.array([[2.0, 0.0], [1.0, 2.0]])
    mask = jnp.array([[1.0, 0.0], [1.0, 1.0]])
    grpo = get_loss("grpo")
    loss, _ = grpo(logp, logp, adv, mask)
    np.testing.assert_allclose(loss, -1.75, rtol=1e-6)
    loss, _ = grpo(logp, logp, adv, mask, agg="token-mean")
    np.testing.assert_allclose(loss, -5 / 3, rtol=1e-6)
    # KL in the loss: ref_logp = -1.5, log r = -0.5, k3 = e^-0.5 + 0.5 - 1 = 0.1065307 on each token
    ref = jnp.full((2, 2), -1.5)
    k3 = math.exp(-0.5) - 0.5
    loss, stats = jax.jit(lambda *a: grpo(*a, ref_logp=ref, kl_coef=0.1))(logp, logp, adv, mask)
    np.testing.assert_allclose(loss, -1.75 + 0.1 * k3, rtol=1e-5)
    np.testing.assert_allclose(stats["kl/loss"], k3, rtol=1e-5)
    with pytest.raises(ValueError, match="needs ref_logp"):
        grpo(logp, logp, adv, mask, kl_coef=0.1)


def test_value_loss_clipping():
    # eps 0.2:
    #   t0: V 1.0, old 0.8 -> clip keeps 1.0; (1.0 - 1.5)^2 = 0.25 both ways
    #   t1: V 2.0, old 1.0 -> V_clip 1.2; max((2-1)^2, (1.2-1)^2) = max(1, 0.04) = 1
    #   t2: V 0.0, old 0.5 -> V_clip 0.3; max((0+1)^2, (0.3+1)^2) = 1.69 (clipped one wins)
    #   loss = 0.5 * (0.25 + 1 + 1.69) / 3 = 0.49
    values = jnp.array([[1.0, 2.0, 0.0, 50.0]])
    old = jnp.array([[0.8, 1.0, 0.5, 0.0]])
    returns = jnp.array([[1.5, 1.0, -1.0, 0.0]])
    mask = jnp.array([[1, 1, 1, 0]])
    loss, stats = jax.jit(value_loss)(values, old, returns, mask)
    np.testing.assert_allclose(loss, 0.49, rtol=1e-5)
    np.testing.assert_allclose(stats["value/clipfrac"], 1 / 3, rtol=1e-6)
    np.testing.assert_allclose(stats["value/mean"], 1.0, rtol=1e-6)
    unclipped, _ = value_loss(values, old, returns, mask, clip_eps=None)
    np.testing.assert_allclose(unclipped, 0.5 * (0.25 + 1.0 + 1.0) / 3, rtol=1e-5)


def test_value_clipfrac_counts_only_clips_that_bind_not_rounding():
    """`value/clipfrac` as verl and TRL count it: tokens whose clipped term is the larger. Inside the band
    V_clip is V itself, so float rounding is never counted (V_old + (V - V_old) was, in ~half the cases)."""
    # eps 0.25:
    #   t0: V 0.1,  old 0.3, R 1 -> inside the band: V_clip = V; (0.1 - 1)^2 = 0.81, not clipped
    #   t1: V 0.05, old 0.2, R 1 -> inside the band: (0.05 - 1)^2 = 0.9025, not clipped
    #   t2: V 2,    old 1,   R 1.5 -> V_clip 1.25 is nearer R: max(0.25, 0.0625) = 0.25, the clip does not bind
    #   t3: V 0,    old 0.5, R -1 -> V_clip 0.25: max(1, 1.5625) = 1.5625, clipped
    #   loss = 0.5 * (0.81 + 0.9025 + 0.25 + 1.5625) / 4 = 0.440625; clipfrac = 1/4
    values = jnp.array([[0.1, 0.05, 2.0, 0.0]], jnp.float32)
    old = jnp.array([[0.3, 0.2, 1.0, 0.5]], jnp.float32)
    returns = jnp.array([[1.0, 1.0, 1.5, -1.0]], jnp.float32)
    mask = jnp.ones((1, 4))
    # t0 and t1 are the rounding cases: in float32, old + (V - old) lands just below V (farther from R)
    v32, o32 = np.asarray(values[0, :2]), np.asarray(old[0, :2])
    assert np.all(o32 + (v32 - o32) < v32)
    loss, stats = jax.jit(lambda *a: value_loss(*a, clip_eps=0.25))(values, old, returns, mask)
    np.testing.assert_allclose(loss, 0.440625, rtol=1e-6)
    assert float(stats["value/clipfrac"]) == 0.25


def test_importance_ratio_early_stop():
    old = jnp.zeros((1, 3))
    logp = jnp.log(jnp.array([[1.0, 4.0, 6.0]]))
    assert not bool(importance_ratio_exploded(logp, old, jnp.array([[1, 1, 0]])))  # 6 is padding
    assert bool(jax.jit(importance_ratio_exploded)(logp, old, jnp.array([[1, 1, 1]])))
    assert not bool(importance_ratio_exploded(logp, old, jnp.array([[1, 1, 1]]), threshold=10.0))


def test_aggregate_and_registry_errors():
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate(ADV, MASK, "sum")
    with pytest.raises(ValueError, match=r"unknown policy loss 'ppoo'\. Did you mean 'ppo'\?.*'grpo'"):
        get_loss("ppoo")
    assert set(POLICY_LOSSES) >= {"ppo", "grpo"}
