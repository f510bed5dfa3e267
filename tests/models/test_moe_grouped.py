"""The grouped mixture-of-experts dispatch (`model.moe_dispatch="grouped"`: assignments sorted by expert,
`jax.lax.ragged_dot`) against the dense one: the same layer outputs and gradients within float32
tolerance, per family, with router replay, and a model's logits; an expert axis is refused in one line."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrlhf.models import moe
from jaxrlhf.models.config import preset
from jaxrlhf.models.transformer import build_model


def _pair(name: str):
    dense = preset(name)
    grouped = dataclasses.replace(dense, moe_dispatch="grouped")
    return (moe.SparseMLP(c, rngs=nnx.Rngs(params=0)) for c in (dense, grouped))


def _loss(mlp, x):
    y, logits = mlp(x, 0)
    return jnp.sum(jnp.sin(y)) + 0.1 * jnp.sum(logits ** 2)


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-mixtral", "tiny-qwen2-moe"])  # qwen2: shared expert
@pytest.mark.parametrize("replay", [False, True])
def test_grouped_equals_dense_outputs_and_gradients(name, replay):
    dense, grouped = _pair(name)
    cfg = preset(name)
    rng = np.random.RandomState(0)
    x = jnp.asarray(rng.randn(2, 5, cfg.hidden_size).astype(np.float32))
    given = rng.randint(-1, cfg.num_experts, size=(1, 2, 5, cfg.num_experts_per_tok)).astype(np.int32)
    given[..., 1] = np.where(given[..., 0] < 0, -1, (given[..., 0] + 1) % cfg.num_experts)
    results = []
    for mlp in (dense, grouped):
        with moe.replaying(jnp.asarray(given) if replay else None):
            (y, logits) = mlp(x, 0)
            grads = nnx.grad(_loss, argnums=(0, 1))(mlp, x)
        results.append((y, logits, grads))
    (yd, ld, gd), (yg, lg, gg) = results
    np.testing.assert_allclose(yg, yd, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(lg, ld)
    flat_d, flat_g = jax.tree.leaves(gd), jax.tree.leaves(gg)
    assert len(flat_d) == len(flat_g)
    for a, b in zip(flat_d, flat_g):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)
    assert float(jnp.abs(gg[0].gate.value).max()) > 0  # the experts do learn through ragged_dot


def test_grouped_model_logits_equal_dense():
    cfg = preset("tiny-qwen3-moe")
    dense = build_model(cfg)
    grouped = build_model(dataclasses.replace(cfg, moe_dispatch="grouped"))
    tokens = jnp.asarray(np.random.RandomState(2).randint(1, cfg.vocab_size, size=(2, 7)), jnp.int32)
    positions, mask = jnp.broadcast_to(jnp.arange(7), (2, 7)), jnp.ones((2, 7), bool)
    want, got = (jax.tree.leaves(m(tokens, positions, mask))[0] for m in (dense, grouped))
    assert want.shape == (2, 7, cfg.vocab_size)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_unknown_dispatch_is_one_line():
    with pytest.raises(ValueError, match="model.moe_dispatch='sorted'"):
        dataclasses.replace(preset("tiny-qwen3-moe"), moe_dispatch="sorted")
