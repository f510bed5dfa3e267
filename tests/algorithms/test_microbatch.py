"""Micro-batching changes memory, not math: micro-batched train and inference calls equal the
whole-minibatch ones (within float tolerance), for every loss normaliser."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrlhf.algorithms import rollout
from jaxrlhf.algorithms.update import map_microbatches, merge_microbatches, split_microbatches
from jaxrlhf.models.config import preset
from jaxrlhf.models.sampling import SamplingParams
from jaxrlhf.models.transformer import build_model, positions_from_mask

B, P, N = 8, 4, 5


def _inputs():
    rng = np.random.RandomState(0)
    tokens = rng.randint(3, 300, size=(B, P + N)).astype(np.int32)
    mask = np.ones((B, P + N), bool)
    mask[:3, 0] = False
    lengths = np.array([5, 1, 3, 5, 2, 4, 5, 1])
    response_mask = np.arange(N)[None, :] < lengths[:, None]
    mask[:, P:] = response_mask
    return {
        "tokens": jnp.asarray(tokens), "mask": jnp.asarray(mask), "positions": positions_from_mask(jnp.asarray(mask)),
        "response_tokens": jnp.asarray(tokens[:, P:]), "response_mask": jnp.asarray(response_mask),
        "behaviour_logp": jnp.asarray(-rng.uniform(1, 6, size=(B, N)).astype(np.float32)),
        "ref_logp": jnp.asarray(-rng.uniform(1, 6, size=(B, N)).astype(np.float32)),
        "rule_scores": jnp.asarray(rng.uniform(-1, 1, size=B).astype(np.float32)),
        "ended_with_eos": jnp.asarray(rng.uniform(size=B) > 0.3), "kl_coef": jnp.float32(0.05),
        "rng_actor": jax.random.key(3),
    }


def test_split_and_merge_are_strided_and_inverse():
    x = jnp.arange(12)
    parts = split_microbatches(x, 3)
    np.testing.assert_array_equal(parts, [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 11]])
    np.testing.assert_array_equal(merge_microbatches(parts), x)
    np.testing.assert_array_equal(map_microbatches(lambda b: b * 2, x, 4), x * 2)


@pytest.fixture(scope="module")
def actor():
    return nnx.split(build_model(preset("tiny"), seed=0))


@pytest.mark.slow
@pytest.mark.parametrize("loss, agg, estimator", [
    ("ppo", "token-mean", "reinforce_pp"),
    ("grpo", "seq-mean-token-mean", "grpo"),
    ("grpo", "seq-mean-token-sum-norm", "grpo"),
])
def test_micro_batched_update_equals_whole_minibatch(actor, loss, agg, estimator):
    graphdef, params = actor
    opt = optax.sgd(0.1)  # Adam would blow float-noise-sized gradients up to full-size steps
    results = []
    for micro in (None, 2):
        s = rollout.RLSettings(estimator=estimator, loss=loss, loss_agg=agg, group_size=2, minibatches=2,
                               micro_batch=micro, kl_in_reward=loss == "ppo", kl_in_loss=loss == "grpo",
                               kl_estimator="k3" if loss == "grpo" else "k1", max_new_tokens=N)
        fn = jax.jit(functools.partial(rollout.actor_train, graphdef, opt, s))
        results.append(fn(params, opt.init(params), _inputs()))
    (p0, _, o0), (p1, _, o1) = results
    for a, b in zip(jax.tree_util.tree_leaves(p0), jax.tree_util.tree_leaves(p1)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for key in ("loss/policy", "entropy", "clipfrac", "grad_norm", "ratio/max"):
        np.testing.assert_allclose(o0["actor_stats"][key], o1["actor_stats"][key], rtol=2e-4, atol=1e-6)


@pytest.mark.slow
def test_micro_batched_inference_equals_whole_batch(actor):
    graphdef, params = actor
    sampling = SamplingParams(temperature=0.7, top_k=20)
    whole = rollout.policy_logprobs(graphdef, sampling, None, params, _inputs())
    micro = jax.jit(functools.partial(rollout.policy_logprobs, graphdef, sampling, 2))(params, _inputs())
    np.testing.assert_allclose(whole["ref_logp"], micro["ref_logp"], rtol=1e-5, atol=1e-5)
