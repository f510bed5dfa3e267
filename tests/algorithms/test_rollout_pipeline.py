"""The advantages the training pipeline actually uses (`rollout.rollout_advantages`: score shaping,
KL placement, estimator and whitening policy together), per algorithm, against hand-computed
numbers or an independent numpy implementation; and one GRPO step end to end through the executor."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.algorithms import rollout

KL_COEF = jnp.float32(0.1)


def _mask(lengths, n):
    return np.arange(n)[None, :] < np.asarray(lengths)[:, None]


def _advantages(inputs, settings, kl_coef=KL_COEF):
    fn = jax.jit(rollout.rollout_advantages, static_argnums=1)
    adv, returns, kl, scores = fn({k: jnp.asarray(v) for k, v in inputs.items()}, settings, kl_coef, None)
    return np.asarray(adv), np.asarray(returns), np.asarray(kl), np.asarray(scores)


def _np_whiten(x, mask, eps=1e-8):
    """Population mean/variance over the masked-in tokens of the whole batch, (x - mean) / sqrt(var + eps)."""
    vals = x[mask]
    mean = vals.mean()
    var = ((vals - mean) ** 2).mean()
    return np.where(mask, (x - mean) / np.sqrt(var + eps), 0.0)


def _np_returns_to_go(rewards, mask, gamma):
    out = np.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        g = 0.0
        for t in reversed(range(rewards.shape[1])):
            if mask[b, t]:
                g = rewards[b, t] + gamma * g
                out[b, t] = g
    return out


def _np_token_rewards(scores, mask, k1, coef):
    """Score on the last response token, -coef * k1 on every response token."""
    r = np.where(mask, -coef * k1, 0.0)
    for b in range(mask.shape[0]):
        r[b, mask[b].sum() - 1] += scores[b]
    return r


# ---------------------------------------------------------------- GRPO

GRPO = rollout.RLSettings(estimator="grpo", loss="grpo", group_size=2, kl_estimator="k3", kl_in_reward=False,
                          kl_in_loss=True, whiten=True, loss_agg="seq-mean-token-mean", max_new_tokens=8)


def _grpo_inputs(ref_shift=0.0):
    n = 8
    rng = np.random.RandomState(0)
    behaviour = -rng.uniform(0.5, 3.0, size=(4, n)).astype(np.float32)
    return {
        "response_mask": _mask([2, 8, 8, 8], n),
        "rule_scores": np.array([1.0, 0.0, 0.0, 0.0], np.float32),
        "ended_with_eos": np.ones(4, bool),
        "behaviour_logp": behaviour,
        "ref_logp": behaviour - ref_shift,
    }


def test_grpo_issue_example_in_the_training_pipeline():
    # Groups of G=2: [1, 0] and [0, 0]; the first sample is 2 tokens long, the others 8.
    adv, returns, _, scores = _advantages(_grpo_inputs(ref_shift=0.0), GRPO)
    np.testing.assert_array_equal(scores, [1.0, 0.0, 0.0, 0.0])
    # mean 0.5, unbiased std sqrt(((0.5)^2 + (0.5)^2) / 1) = sqrt(0.5) = 0.7071068:
    # A = +-0.5 / (0.7071068 + 1e-6) = +-0.7071058, on every response token of the sequence.
    std = np.std(np.array([1.0, 0.0], np.float32), ddof=1)
    a = (1.0 - 0.5) / (std + 1e-6)
    np.testing.assert_allclose(a, 0.7071058, rtol=1e-6)
    np.testing.assert_allclose(adv[0, :2], [a, a], rtol=1e-6)
    np.testing.assert_allclose(adv[1], [-a] * 8, rtol=1e-6)
    np.testing.assert_array_equal(adv[0, 2:], 0.0)  # padding
    # The all-equal group is exactly 0: whiten=True does not apply (GRPO's policy is "never"),
    # and the advantage does not depend on the lengths of the responses.
    np.testing.assert_array_equal(adv[2:], 0.0)
    np.testing.assert_array_equal(returns, adv)


def test_grpo_kl_goes_into_the_loss_not_the_advantage():
    base, _, kl0, _ = _advantages(_grpo_inputs(ref_shift=0.0), GRPO)
    shifted, _, kl, _ = _advantages(_grpo_inputs(ref_shift=0.7), GRPO)
    # The KL is really there (k3 of a log-ratio of 0.7 per token) ...
    np.testing.assert_array_equal(kl0, 0.0)
    expected_k3 = math.exp(-0.7) + 0.7 - 1.0  # r = pi_ref / pi = e^-0.7: (r - 1) - log r = 0.1965853
    np.testing.assert_allclose(kl[1], expected_k3, rtol=1e-4)
    # ... but it does not move the GRPO advantages at all.
    np.testing.assert_array_equal(shifted, base)
    # Nor does whitening, whichever way it is set.
    unwhitened, _, _, _ = _advantages(_grpo_inputs(ref_shift=0.7), dataclasses.replace(GRPO, whiten=False))
    np.testing.assert_array_equal(unwhitened, base)


def test_grpo_truncated_response_gets_no_score_with_eos_only():
    inputs = _grpo_inputs()
    inputs["ended_with_eos"] = np.array([False, True, True, True])  # the 1.0 response was cut off
    adv, _, _, scores = _advantages(inputs, GRPO)
    np.testing.assert_array_equal(scores, [0.0, 0.0, 0.0, 0.0])
    np.testing.assert_array_equal(adv, 0.0)  # both groups now all-equal


# ---------------------------------------------------------------- RLOO

RLOO = rollout.RLSettings(estimator="rloo", group_size=2, kl_estimator="k1", kl_in_reward=True, whiten=True)


def test_rloo_leave_one_out_over_rewards_with_the_kl_sum():
    mask = _mask([3, 2, 3, 1], 3)
    ref = np.full((4, 3), -2.0, np.float32)
    # k1 = logp - ref; masked positions hold garbage that must not count
    k1 = np.array([[0.2, 0.1, 0.3], [0.5, -0.1, 9.0], [0.0, 0.0, 0.0], [1.0, 9.0, 9.0]], np.float32)
    inputs = {
        "response_mask": mask, "rule_scores": np.array([1.0, 0.0, 0.5, 0.5], np.float32),
        "ended_with_eos": np.ones(4, bool), "behaviour_logp": ref + k1, "ref_logp": ref,
    }
    adv, _, _, _ = _advantages(inputs, RLOO)
    # sequence rewards score - 0.1 * sum(k1):
    #   r0 = 1 - 0.1 * 0.6 = 0.94,  r1 = 0 - 0.1 * 0.4 = -0.04,  r2 = 0.5,  r3 = 0.5 - 0.1 * 1.0 = 0.4
    # leave-one-out with G=2: A_i = r_i - r_other
    #   A = [0.98, -0.98, 0.1, -0.1], broadcast to the response tokens, not whitened
    expected = np.array([0.98, -0.98, 0.1, -0.1])[:, None] * mask
    np.testing.assert_allclose(adv, expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- REINFORCE++


@pytest.mark.parametrize("gamma", [1.0, 0.5])
def test_reinforce_pp_token_returns_normalised_over_the_batch(gamma):
    rng = np.random.RandomState(3)
    b, n = 4, 5
    mask = _mask([5, 3, 1, 4], n)
    behaviour = -rng.uniform(0.1, 2.0, size=(b, n)).astype(np.float32)
    ref = -rng.uniform(0.1, 2.0, size=(b, n)).astype(np.float32)
    scores = np.array([1.0, -0.5, 2.0, 0.0], np.float32)
    inputs = {"response_mask": mask, "rule_scores": scores, "ended_with_eos": np.ones(b, bool),
              "behaviour_logp": behaviour, "ref_logp": ref}
    settings = rollout.RLSettings(estimator="reinforce_pp", kl_estimator="k1", kl_in_reward=True, gamma=gamma,
                                  whiten=True)
    adv, returns, _, _ = _advantages(inputs, settings)

    k1 = behaviour.astype(np.float64) - ref
    rewards = _np_token_rewards(scores.astype(np.float64), mask, k1, 0.1)
    g = _np_returns_to_go(rewards, mask, gamma)
    np.testing.assert_allclose(returns, g, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(adv, _np_whiten(g, mask), rtol=1e-4, atol=1e-5)
    # Normalised over all 13 response tokens of the batch (population statistics).
    assert abs(adv[mask].mean()) < 1e-5 and abs(adv[mask].std() - 1.0) < 1e-4


# ---------------------------------------------------------------- ReMax

REMAX = rollout.RLSettings(estimator="remax", kl_estimator="k1", kl_in_reward=True, whiten=True)


def _remax_inputs(greedy_ended):
    mask = _mask([3, 2, 3], 3)
    ref = np.full((3, 3), -1.0, np.float32)
    k1 = np.array([[0.1, 0.2, 0.3], [0.4, 0.0, 5.0], [0.0, 0.0, 0.0]], np.float32)
    return {
        "response_mask": mask, "rule_scores": np.array([1.0, 1.0, 0.0], np.float32),
        "ended_with_eos": np.array([True, True, False]),
        "greedy_rule_scores": np.array([0.5, 2.0, 0.25], np.float32),
        "greedy_ended_with_eos": np.asarray(greedy_ended),
        "behaviour_logp": ref + k1, "ref_logp": ref,
    }


def test_remax_returns_to_go_minus_the_shaped_greedy_score():
    adv, _, _, scores = _advantages(_remax_inputs([True, True, True]), REMAX)
    # sampled scores with the EOS gate: [1, 1, 0] (row 2 did not end with EOS)
    np.testing.assert_array_equal(scores, [1.0, 1.0, 0.0])
    # token rewards -0.1 k1, score on the last token:
    #   row 0: [-0.01, -0.02, 1 - 0.03] -> returns-to-go [0.94, 0.95, 0.97], minus greedy 0.5
    #   row 1: [-0.04, 1 - 0.0]         -> [0.96, 1.0],                     minus greedy 2.0
    #   row 2: [0, 0, 0]                -> [0, 0, 0],                       minus greedy 0.25
    expected = np.array([[0.44, 0.45, 0.47], [-1.04, -1.0, 0.0], [-0.25, -0.25, -0.25]])
    np.testing.assert_allclose(adv, expected, rtol=1e-5, atol=1e-6)


def test_remax_eos_gate_applies_to_the_greedy_score():
    adv, _, _, _ = _advantages(_remax_inputs([True, False, False]), REMAX)
    # greedy responses 1 and 2 were cut off: their baseline is 0, not 2.0 / 0.25
    expected = np.array([[0.44, 0.45, 0.47], [0.96, 1.0, 0.0], [0.0, 0.0, 0.0]])
    np.testing.assert_allclose(adv, expected, rtol=1e-5, atol=1e-6)
    # and with eos_only off the greedy score counts even when cut off
    settings = rollout.RLSettings(estimator="remax", kl_estimator="k1", kl_in_reward=True, eos_only=False)
    adv, _, _, _ = _advantages(_remax_inputs([True, False, False]), settings)
    # row 2's own score 0 is now kept too (it was 0 anyway)
    np.testing.assert_allclose(adv[1], [0.96 - 2.0, 1.0 - 2.0, 0.0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(adv[2], [-0.25, -0.25, -0.25], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- PPO / GAE


def _np_gae(rewards, values, mask, gamma, lam):
    b, n = rewards.shape
    adv = np.zeros((b, n))
    for i in range(b):
        length = int(mask[i].sum())
        nxt = 0.0
        for t in reversed(range(length)):
            v_next = 0.0 if t == length - 1 else values[i, t + 1]  # no bootstrap, truncated or not
            delta = rewards[i, t] + gamma * v_next - values[i, t]
            nxt = delta + gamma * lam * nxt
            adv[i, t] = nxt
    return adv


@pytest.mark.parametrize("whiten", [True, False])
def test_ppo_gae_whitened_over_the_global_batch(whiten):
    rng = np.random.RandomState(7)
    b, n = 4, 4
    mask = _mask([4, 2, 3, 1], n)
    behaviour = -rng.uniform(0.1, 2.0, size=(b, n)).astype(np.float32)
    ref = -rng.uniform(0.1, 2.0, size=(b, n)).astype(np.float32)
    values = rng.normal(size=(b, n)).astype(np.float32)
    ended = np.array([True, False, True, False])  # rows 1 and 3 were cut at the length limit
    scores = np.array([1.0, 2.0, -1.0, 0.5], np.float32)
    inputs = {"response_mask": mask, "rule_scores": scores, "ended_with_eos": ended, "behaviour_logp": behaviour,
              "ref_logp": ref, "values": values}
    settings = rollout.RLSettings(estimator="gae", gamma=1.0, lam=0.95, kl_estimator="k1", kl_in_reward=True,
                                  whiten=whiten)
    adv, returns, _, shaped = _advantages(inputs, settings)

    # eos_only: the truncated rows get score 0 (and, like every row, V = 0 after their last token).
    np.testing.assert_array_equal(shaped, [1.0, 0.0, -1.0, 0.0])
    k1 = behaviour.astype(np.float64) - ref
    rewards = _np_token_rewards(np.array([1.0, 0.0, -1.0, 0.0]), mask, k1, 0.1)
    raw = _np_gae(rewards, np.where(mask, values, 0.0), mask, 1.0, 0.95)
    # returns are built from the advantages *before* whitening
    np.testing.assert_allclose(returns, np.where(mask, raw + values, 0.0), rtol=1e-5, atol=1e-5)
    expected = _np_whiten(raw, mask) if whiten else raw
    np.testing.assert_allclose(adv, expected, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- end to end through the executor


@pytest.fixture(scope="module")
def grpo_step():
    """One GRPO step, set up as `jaxrlhf.train.run` does, with a rule that scores every response 1."""
    from jaxrlhf import config as cfglib
    from jaxrlhf.algorithms import build_algorithm
    from jaxrlhf.models.tokenizer import load_tokenizer
    from jaxrlhf.placement.calls import CallCache
    from jaxrlhf.placement.executor import Executor
    from jaxrlhf.placement.layout import AxisRules
    from jaxrlhf.run.planning import plan_for, role_configs
    from jaxrlhf.run.roles import build_roles

    cfg = cfglib.load_config(None, [
        "model.actor.preset=tiny", "algorithm.name=grpo", "algorithm.group_size=2", "algorithm.minibatches=1",
        "data.batch_size=4", "data.max_prompt_len=16", "generation.max_new_tokens=4", "run.steps=1",
        "sft.steps=0", "rewards.eos_only=false",
        'rewards.rules=[{name: format, weight: 1.0, args: {pattern: ".*"}}]',
    ])
    cfglib.validate(cfg)
    algorithm = build_algorithm(cfg)
    tokenizer = load_tokenizer(cfg.model.tokenizer)
    specs = algorithm.roles()
    model_configs = role_configs(cfg, list(specs))
    graph = algorithm.graph()
    plan = plan_for(cfg, algorithm, model_configs, jax.device_count())
    cache = CallCache(plan, rules=AxisRules.from_config(cfg.plan.axis_rules))
    roles = build_roles(cfg, specs, model_configs, cache, plan, total_updates=algorithm.updates_per_step)
    algorithm.bind(tokenizer, roles)
    executor = Executor(plan, graph, roles, cache=cache, functions=algorithm.functions(),
                        host_steps=algorithm.host_steps(), state=algorithm.initial_state())
    executor.commit_state()
    data = algorithm.dataset(tokenizer)
    result = executor.step(algorithm.feed(data.next_batch(), jax.random.fold_in(jax.random.key(cfg.run.seed), 1)))
    return algorithm, result


@pytest.mark.slow
def test_grpo_step_with_equal_group_rewards_has_zero_advantages(grpo_step):
    algorithm, result = grpo_step
    assert set(algorithm.roles()) == {"actor", "ref"}  # kl_coef 0.1: KL to the reference, in the loss
    values = result.values
    rule_scores = np.asarray(values["rule_scores"])
    adv = np.asarray(jax.device_get(values["advantages"]))
    rmask = np.asarray(jax.device_get(values["response_mask"]))
    # 4 prompts x 2 samples, 4 new tokens; every response scored 1 -> every group all-equal.
    assert adv.shape == (8, 4) and rmask.shape == (8, 4)
    np.testing.assert_array_equal(rule_scores, np.ones(8, np.float32))
    np.testing.assert_array_equal(adv, np.zeros((8, 4), np.float32))
    metrics = algorithm.metrics(result)
    assert metrics["advantages/mean"] == 0.0
    assert metrics["reward/mean"] == 1.0
    assert math.isfinite(metrics["loss/policy"]) and math.isfinite(metrics["kl/token_mean"])
