"""`generation.trim_responses`: the rollout batch cut to its longest response changes the cost of the
train and inference calls, not their math (the same updates, log-probs, values and statistics as on
the full width), and the graph routes every later call through the cut."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrlhf import config as cfglib
from jaxrlhf.algorithms import build_algorithm, rollout
from jaxrlhf.algorithms.rl import GENERATED
from jaxrlhf.models.config import preset
from jaxrlhf.models.lengths import response_width, response_widths
from jaxrlhf.models.sampling import SamplingParams
from jaxrlhf.models.transformer import build_model, positions_from_mask

B, P, N = 8, 4, 16
LENGTHS = np.array([5, 1, 3, 7, 2, 4, 6, 1])  # the longest is 7: cut to width 8 of 16


def test_widths_by_hand():
    # max_new_tokens / 2^k (k < 4), rounded up to a multiple of 8, at most max_new_tokens
    assert response_widths(64) == (8, 16, 32, 64)
    assert response_widths(512) == (64, 128, 256, 512)
    assert response_widths(100) == (16, 32, 56, 100)
    assert response_widths(12) == (8, 12)
    assert response_widths(8) == (8,) and response_widths(4) == (4,)
    assert [response_width(n, 64) for n in (0, 1, 8, 9, 16, 17, 33, 64)] == [8, 8, 8, 16, 16, 32, 64, 64]


def _full_batch():
    rng = np.random.RandomState(0)
    tokens = rng.randint(3, 300, size=(B, P + N)).astype(np.int32)
    mask = np.ones((B, P + N), bool)
    mask[:3, 0] = False  # left padding in three prompts
    response_mask = np.arange(N)[None, :] < LENGTHS[:, None]
    mask[:, P:] = response_mask
    tokens = np.where(mask, tokens, 0)
    return {
        "tokens": tokens, "mask": mask, "positions": np.asarray(positions_from_mask(jnp.asarray(mask))),
        "response_tokens": tokens[:, P:], "response_mask": response_mask,
        "behaviour_logp": np.where(response_mask, -rng.uniform(1, 6, size=(B, N)), 0.0).astype(np.float32),
        "ended_with_eos": rng.uniform(size=B) > 0.3,
    }


def _call_inputs(batch):
    rng = np.random.RandomState(1)
    out = {k: jnp.asarray(v) for k, v in batch.items()}
    n = batch["response_mask"].shape[1]
    out.update(ref_logp=jnp.asarray(np.where(batch["response_mask"], -rng.uniform(1, 6, size=(B, N))[:, :n], 0.0),
                                    jnp.float32),
               values=jnp.asarray(np.where(batch["response_mask"], rng.normal(size=(B, N))[:, :n], 0.0), jnp.float32),
               rule_scores=jnp.asarray(rng.uniform(-1, 1, size=B), jnp.float32), kl_coef=jnp.float32(0.05),
               rng_actor=jax.random.key(3), rng_critic=jax.random.key(4))
    return out


def test_trim_cuts_every_generated_value_to_the_longest_response():
    full = _full_batch()
    cut = rollout.trim_responses(full, N)
    assert set(cut) == set(GENERATED)
    assert cut["tokens"].shape == (B, P + 8) and cut["response_mask"].shape == (B, 8)
    assert cut["behaviour_logp"].shape == (B, 8) and cut["ended_with_eos"].shape == (B,)
    np.testing.assert_array_equal(cut["tokens"], full["tokens"][:, :P + 8])
    np.testing.assert_array_equal(cut["positions"], full["positions"][:, :P + 8])
    np.testing.assert_array_equal(cut["response_mask"].sum(axis=1), LENGTHS)  # no response token is lost
    # a batch whose longest response fills the cap is not cut
    assert rollout.trim_responses({**full, "response_mask": np.ones((B, N), bool)}, N)["tokens"].shape == (B, P + N)


@pytest.fixture(scope="module")
def models():
    return nnx.split(build_model(preset("tiny"), seed=0)), nnx.split(build_model(preset("tiny"), "value", seed=1))


def _close(a, b, **tol):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **tol)


@pytest.mark.slow
@pytest.mark.parametrize("estimator, loss, agg", [
    ("gae", "ppo", "token-mean"),
    ("grpo", "grpo", "seq-mean-token-sum-norm"),  # Dr. GRPO: normalised by max_new_tokens, not the width
])
def test_calls_on_the_cut_batch_equal_the_full_width(models, estimator, loss, agg):
    (actor_def, actor), (critic_def, critic) = models
    full, cut = _call_inputs(_full_batch()), _call_inputs(rollout.trim_responses(_full_batch(), N))
    opt = optax.sgd(0.1)  # Adam would blow float-noise-sized gradients up to full-size steps
    s = rollout.RLSettings(estimator=estimator, loss=loss, loss_agg=agg, group_size=2, minibatches=2,
                           kl_in_reward=loss == "ppo", kl_in_loss=loss == "grpo",
                           kl_estimator="k3" if loss == "grpo" else "k1", max_new_tokens=N)
    width = cut["response_mask"].shape[1]
    if estimator == "gae":
        from jaxrlhf.algorithms.stats import RunningMoments
        for inputs in (full, cut):
            inputs["value_moments"] = RunningMoments.create()

    train = jax.jit(functools.partial(rollout.actor_train, actor_def, opt, s))
    (p_full, _, o_full), (p_cut, _, o_cut) = (train(actor, opt.init(actor), x) for x in (full, cut))
    _close(p_full, p_cut, rtol=1e-5, atol=1e-6)
    for key, value in o_full["actor_stats"].items():
        np.testing.assert_allclose(o_cut["actor_stats"][key], value, rtol=2e-4, atol=1e-6, err_msg=key)
    np.testing.assert_allclose(o_cut["advantages"], o_full["advantages"][:, :width], rtol=1e-5, atol=1e-6)
    assert not np.asarray(o_full["advantages"][:, width:]).any()  # nothing but padding was cut

    sampling = SamplingParams(temperature=0.7)
    logp = [rollout.policy_logprobs(actor_def, sampling, None, actor, x)["ref_logp"] for x in (full, cut)]
    np.testing.assert_allclose(logp[1], logp[0][:, :width], rtol=1e-5, atol=1e-5)
    if estimator == "gae":
        values = [rollout.critic_values(critic_def, None, critic, x)["values"] for x in (full, cut)]
        np.testing.assert_allclose(values[1], values[0][:, :width], rtol=1e-5, atol=1e-5)
        critic_train = jax.jit(functools.partial(rollout.critic_train, critic_def, opt, s))
        (c_full, _, co_full), (c_cut, _, co_cut) = (critic_train(critic, opt.init(critic), x) for x in (full, cut))
        _close(c_full, c_cut, rtol=1e-5, atol=1e-6)
        _close(co_full, co_cut, rtol=2e-4, atol=1e-6)


def _graph(*overrides):
    cfg = cfglib.load_config(None, ["model.actor.preset=tiny", "data.batch_size=4", "sft.steps=0", *overrides])
    cfglib.validate(cfg)
    return build_algorithm(cfg).graph()


def test_graph_routes_later_calls_through_the_cut():
    graph = _graph("algorithm.name=ppo", "generation.max_new_tokens=16")
    assert graph["actor.generate"].outputs == tuple("full_" + v for v in GENERATED)
    order = [n.name for n in graph.order()]
    assert order.index("trim_responses") < min(order.index(c) for c in ("critic.inference", "actor.train"))
    # one width only (max_new_tokens <= 8), or switched off: nothing to cut, no host step
    for overrides in (("generation.max_new_tokens=8",),
                      ("generation.max_new_tokens=16", "generation.trim_responses=false"),
                      ("generation.max_new_tokens=16", "generation.ignore_eos=true", "rewards.eos_only=false")):
        graph = _graph("algorithm.name=ppo", *overrides)
        assert "trim_responses" not in [h.name for h in graph.host_steps]
        assert graph["actor.generate"].outputs == GENERATED
    # DAPO: the generate call fills the pool, the selected groups are cut
    dapo = _graph("algorithm.name=dapo", "algorithm.group_size=2", "generation.max_new_tokens=16")
    assert dapo["actor.generate"].outputs[0] == "pool_tokens"
    host_order = [h.name for h in dapo.order() if not hasattr(h, "role")]
    assert host_order[:3] == ["score_rules", "select_groups", "trim_responses"]
    assert dapo.node("select_groups").outputs[:len(GENERATED)] == tuple("full_" + v for v in GENERATED)
