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


@pytest.mark.parametrize("layout", [dict(expert=2), dict(expert=4), dict(tensor=2, expert=2)], ids=str)
def test_grouped_on_an_expert_axis_equals_the_single_device_dense_dispatch(layout):
    """Each device groups its gathered tokens over its local experts only (other devices' picks go to no
    group): the layer's output and gradients as the dense dispatch's on one device."""
    from jaxrlhf.models import axes as ax
    from jaxrlhf.placement.layout import activation_resolver, make_mesh, param_shardings
    from jaxrlhf.planner.plan import DeviceGroup, Layout

    name = "tiny-qwen2-moe"  # 8 experts, top 2, a shared expert
    dense, grouped = _pair(name)
    x = jnp.asarray(np.random.RandomState(3).randn(4, 6, preset(name).hidden_size).astype(np.float32))
    want_y, _ = dense(x, 0)
    want_g = nnx.grad(_loss)(dense, x)
    lay = Layout(**layout)
    mesh = make_mesh(DeviceGroup("g", 0, lay.num_devices), lay)
    graphdef, params = nnx.split(grouped)
    placed = jax.device_put(params, param_shardings(params, mesh))

    @jax.jit
    def run(p, x):
        with ax.activation_sharding(activation_resolver(mesh)):
            assert ax.expert_ways() == lay.expert
            y = nnx.merge(graphdef, p)(x, 0)[0]
            return y, jax.grad(lambda q: _loss(nnx.merge(graphdef, q), x))(p)

    y, grads = run(placed, x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want_y), rtol=1e-5, atol=1e-5)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(nnx.state(want_g))):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)
