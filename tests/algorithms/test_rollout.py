"""The rollout call functions: value alignment and the non-finite guard."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrlhf.algorithms import rollout
from jaxrlhf.algorithms.optim import build_optimizer
from jaxrlhf.models.config import preset
from jaxrlhf.models.transformer import build_model, positions_from_mask

B, P, N = 4, 4, 3


def _batch():
    rng = np.random.RandomState(0)
    tokens = rng.randint(3, 300, size=(B, P + N)).astype(np.int32)
    mask = np.ones((B, P + N), bool)
    mask[0, 0] = False  # a left-padded prompt
    response_mask = np.array([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], bool)
    mask[:, P:] = response_mask
    tokens[:, 0][~mask[:, 0]] = 0
    return jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(response_mask)


@pytest.fixture(scope="module")
def critic():
    model = build_model(preset("tiny"), "value", seed=0)
    # A non-zero head so values differ per position.
    model.value_head.value = jax.random.normal(jax.random.key(1), model.value_head.value.shape)
    return nnx.split(model)


@pytest.mark.slow
def test_values_are_aligned_with_response_tokens(critic):
    graphdef, state = critic
    tokens, mask, response_mask = _batch()
    positions = positions_from_mask(mask)
    out = rollout.critic_values(graphdef, None, state, {"tokens": tokens, "mask": mask, "positions": positions,
                                                  "response_mask": response_mask})
    values = out["values"]
    full = nnx.merge(graphdef, state)(tokens, positions, mask)
    # V(s_t) for response token t is the output at position P-1+t; masked tokens are 0.
    np.testing.assert_allclose(values[:, 0], full[:, P - 1], rtol=1e-6)
    np.testing.assert_allclose(values[0, 2], full[0, P + 1], rtol=1e-6)
    assert float(values[1, 2]) == 0.0 and float(values[2, 1]) == 0.0
    assert set(out) == {"values"}  # nothing after the last token: GAE does not bootstrap


def _inputs(scores):
    tokens, mask, response_mask = _batch()
    zeros = jnp.zeros((B, N), jnp.float32)
    return {
        "tokens": tokens, "mask": mask, "positions": positions_from_mask(mask), "response_tokens": tokens[:, P:],
        "response_mask": response_mask, "behaviour_logp": zeros - 5.0, "ref_logp": zeros - 5.0,
        "rule_scores": scores, "ended_with_eos": jnp.ones((B,), bool), "kl_coef": jnp.float32(0.1),
        "rng_actor": jax.random.key(0),
    }


@pytest.mark.slow
@pytest.mark.parametrize("bad", [False, True])
def test_nonfinite_update_is_skipped_and_counted(bad):
    model = build_model(preset("tiny"), "lm", seed=0)
    graphdef, state = nnx.split(model)
    opt = build_optimizer(lr=1e-2, total_updates=10)
    opt_state = opt.init(state)
    scores = jnp.array([1.0, -1.0, 0.5, jnp.nan if bad else 0.0])
    settings = rollout.RLSettings(estimator="reinforce_pp", minibatches=2, epochs=1, ratio_early_stop=None)
    fn = jax.jit(functools.partial(rollout.actor_train, graphdef, opt, settings))
    new_state, new_opt_state, out = fn(state, opt_state, _inputs(scores))
    stats = out["actor_stats"]
    before, after = jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(new_state)
    unchanged = all(np.array_equal(a, b) for a, b in zip(before, after))
    if bad:
        # The NaN score normalises into every advantage: both updates are skipped, nothing changes.
        assert unchanged
        assert float(stats["skipped_nonfinite"]) == 2.0
        assert all(np.array_equal(a, b) for a, b in zip(
            jax.tree_util.tree_leaves(opt_state), jax.tree_util.tree_leaves(new_opt_state)))
    else:
        assert not unchanged
        assert float(stats["skipped_nonfinite"]) == 0.0
