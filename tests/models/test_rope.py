"""Rotary tables: looked up per token they equal cos/sin of the token's own angles, and a train step's
program computes its sines and cosines once, not in every layer's rotation and its gradient."""

import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrlhf.models.config import preset
from jaxrlhf.models.transformer import build_model, positions_from_mask, rope_inv_frequencies, rope_tables


def test_table_lookup_equals_the_direct_angles():
    inv_freq = rope_inv_frequencies(preset("tiny"))
    mask = jnp.array([[False, False, True, True, True, True], [True] * 6])
    positions = positions_from_mask(mask)
    angles = positions[..., None].astype(jnp.float32) * inv_freq
    cos, sin = jax.jit(rope_tables, static_argnums=2)(positions, inv_freq, 6)
    assert cos.shape == sin.shape == (2, 6, 1, inv_freq.shape[0])
    np.testing.assert_allclose(cos[:, :, 0], jnp.cos(angles), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(sin[:, :, 0], jnp.sin(angles), rtol=1e-6, atol=1e-7)
    # A decode step (one token a row) at positions past the prompt computes its angles directly.
    step = jnp.array([[9], [40]])
    cos1, sin1 = rope_tables(step, inv_freq, 48)
    np.testing.assert_allclose(cos1[:, :, 0], jnp.cos(step[..., None] * inv_freq), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(sin1[:, :, 0], jnp.sin(step[..., None] * inv_freq), rtol=1e-6, atol=1e-7)


def test_a_train_step_computes_the_angles_once():
    cfg = preset("tiny", num_layers=3)
    graphdef, state = nnx.split(build_model(cfg, seed=0))
    tokens = jax.random.randint(jax.random.key(0), (2, 8), 0, cfg.vocab_size)
    mask = jnp.ones((2, 8), bool)

    def loss(state):
        logits, _ = nnx.merge(graphdef, state)(tokens, positions_from_mask(mask), mask)
        return jnp.mean(jax.nn.logsumexp(logits, -1))

    hlo = jax.jit(jax.grad(loss)).lower(state).compile().as_text()
    # One sine and one cosine for the table (before: one of each fused into every rotation of queries
    # and keys in every layer, and into their gradients).
    assert len(re.findall(r"\bsine\(", hlo)) == 1 and len(re.findall(r"\bcosine\(", hlo)) == 1
