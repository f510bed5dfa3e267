"""Logits a chunk of positions at a time change memory, not math: the chunked log-probs, entropies and
their gradients equal the unchunked ones, and a chunked actor update equals an unchunked one."""

from __future__ import annotations

import functools

import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrlhf.algorithms import rollout
from jaxrlhf.models.config import preset
from jaxrlhf.models.logit_chunks import chunked_token_stats
from jaxrlhf.models.logit_sizes import chunk_count, chunk_positions
from jaxrlhf.models.sampling import SamplingParams, entropy, token_logprobs
from jaxrlhf.models.transformer import build_model, positions_from_mask


def test_enough_chunks_to_keep_the_budget_a_device():
    assert chunk_count(4, 12, None) == 1  # no budget: one chunk
    assert chunk_count(4, 12, 64) == 1  # 48 positions fit
    assert chunk_count(4, 12, 16) == 3  # 48 / 3 = 16
    assert chunk_count(4, 12, 10) == 5  # 48 / 5 < 10 (the length is padded to 15)
    assert chunk_count(4, 12, 16, batch_ways=2) == 2  # 24 positions a device
    assert chunk_count(4, 12, 1) == 12  # at least a device's rows: one position a row
    assert chunk_count(4, 12, 1, length_ways=2) == 6  # a row's 12 positions on two context devices
    # the planner's count of one chunk's positions a device
    assert chunk_positions(48, 4, None) == 48 and chunk_positions(48, 4, 16) == 16 and chunk_positions(48, 4, 1) == 4


def _head_and_data():
    rng = np.random.RandomState(0)
    hidden = jnp.asarray(rng.normal(size=(3, 8, 16)).astype(np.float32))
    w = jnp.asarray(rng.normal(size=(16, 50)).astype(np.float32) / 4)
    targets = jnp.asarray(rng.randint(0, 50, size=(3, 8)).astype(np.int32))
    return hidden, w, targets


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.7, top_k=10, top_p=0.9)])
def test_chunked_stats_and_gradients_equal_unchunked(sampling):
    hidden, w, targets = _head_and_data()

    def unchunked(h, w):
        logits = h @ w
        return token_logprobs(logits, targets, sampling), entropy(logits, sampling)

    def chunked(h, w):
        return chunked_token_stats(lambda x: x @ w, h, targets, sampling, budget=5)  # 5 chunks, padded to 10

    assert chunk_count(3, 8, 5) == 5
    for got, want in zip(chunked(hidden, w), unchunked(hidden, w)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)

    def loss(fn, h, w):
        logp, ent = fn(h, w)
        return jnp.sum(logp * jnp.arange(8)) - 0.1 * jnp.sum(ent)

    got = jax.grad(functools.partial(loss, chunked), argnums=(0, 1))(hidden, w)
    want = jax.grad(functools.partial(loss, unchunked), argnums=(0, 1))(hidden, w)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    logp, ent = chunked_token_stats(lambda x: x @ w, hidden, targets, sampling, budget=6, with_entropy=False)
    assert ent is None
    np.testing.assert_allclose(logp, unchunked(hidden, w)[0], rtol=1e-6, atol=1e-6)


def test_chunks_recompute_their_logits_in_the_backward(capsys):
    """The backward saves no full-vocabulary logits (the vocabulary is 50 wide): besides its arguments, it
    saves the chunked hidden states and targets, and recomputes each chunk's logits."""
    hidden, w, targets = _head_and_data()

    def loss(h, w):
        logp, ent = chunked_token_stats(lambda x: x @ w, h, targets, SamplingParams(), budget=6)
        return jnp.sum(logp) + jnp.sum(ent)

    jax.ad_checkpoint.print_saved_residuals(loss, hidden, w)
    saved = [line for line in capsys.readouterr().out.splitlines() if "from the argument" not in line]
    assert saved and not [line for line in saved if ",50]" in line.split()[0]], saved


B, P, N = 4, 4, 6


def _inputs():
    rng = np.random.RandomState(1)
    tokens = rng.randint(3, 300, size=(B, P + N)).astype(np.int32)
    mask = np.ones((B, P + N), bool)
    mask[:2, 0] = False
    response_mask = np.arange(N)[None, :] < np.array([6, 2, 4, 5])[:, None]
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


@pytest.mark.slow
def test_a_chunked_actor_update_and_log_probs_equal_unchunked():
    graphdef, params = nnx.split(build_model(preset("tiny"), seed=0))
    sampling = SamplingParams(temperature=0.7, top_k=20)
    logp = [rollout.policy_logprobs(graphdef, sampling, None, params, _inputs(), logit_chunk=c)["ref_logp"]
            for c in (None, 4)]
    np.testing.assert_allclose(logp[1], logp[0], rtol=1e-5, atol=1e-5)
    opt = optax.sgd(0.1)
    results = []
    for chunk in (None, 4):  # 24 response positions, 6 chunks of 4
        s = rollout.RLSettings(estimator="grpo", loss="grpo", group_size=2, minibatches=1, kl_in_reward=False,
                               kl_in_loss=True, kl_estimator="k3", max_new_tokens=N, entropy_coef=0.01,
                               sampling=sampling, logit_chunk=chunk)
        results.append(jax.jit(functools.partial(rollout.actor_train, graphdef, opt, s))(params, opt.init(params),
                                                                                         _inputs()))
    (p0, _, o0), (p1, _, o1) = results
    for a, b in zip(jax.tree_util.tree_leaves(p0), jax.tree_util.tree_leaves(p1)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for key in ("loss/policy", "entropy", "grad_norm"):
        np.testing.assert_allclose(o0["actor_stats"][key], o1["actor_stats"][key], rtol=2e-4, atol=1e-6)
