"""Scanned layers and remat: every remat policy gives the same loss and gradients as none, and the
unrolled layer loop of shallow models the same as the rolled one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrlhf.models import config as model_config
from jaxrlhf.models.config import preset
from jaxrlhf.models.transformer import build_model, positions_from_mask, remat_policy


def _loss_and_grads(remat: str, unroll_layers: bool | None = None):
    cfg = preset("tiny", num_layers=3, unroll_layers=unroll_layers)
    model = build_model(cfg, seed=1, remat=remat)
    graphdef, state = nnx.split(model)
    tokens = jax.random.randint(jax.random.key(0), (2, 7), 0, cfg.vocab_size)
    mask = jnp.ones((2, 7), bool).at[1, :2].set(False)

    def loss(state):
        logits, _ = nnx.merge(graphdef, state)(tokens, positions_from_mask(mask), mask)
        return jnp.mean(jax.nn.logsumexp(logits, -1) * mask)

    return jax.jit(jax.value_and_grad(loss))(state)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["full", "dots"])
def test_remat_policies_match_no_remat(policy):
    ref_loss, ref_grads = _loss_and_grads("none")
    loss, grads = _loss_and_grads(policy)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_unrolled_layer_loop_matches_the_rolled_one():
    """The same loss and gradients whether the stacked layers run as a rolled or an unrolled loop (the
    tiny model's 3 layers unroll by default; `unroll_layers=False` keeps the loop rolled)."""
    assert preset("tiny", num_layers=3).unrolls_layers
    unrolled_loss, unrolled_grads = _loss_and_grads("none")
    rolled_loss, rolled_grads = _loss_and_grads("none", unroll_layers=False)
    np.testing.assert_allclose(unrolled_loss, rolled_loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(unrolled_grads), jax.tree.leaves(rolled_grads)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_shallow_models_compile_without_a_layer_loop():
    def lowered(cfg):
        tokens = jnp.zeros((1, 4), jnp.int32)
        mask = jnp.ones((1, 4), bool)
        forward = lambda m: m(tokens, positions_from_mask(mask), mask)[0]  # noqa: E731
        return nnx.jit(forward).lower(build_model(cfg)).as_text()

    assert "while" not in lowered(preset("tiny", num_layers=3))
    assert "while" in lowered(preset("tiny", num_layers=3, unroll_layers=False))
    assert "while" in lowered(preset("tiny", num_layers=model_config.UNROLL_MAX_LAYERS["cpu"] + 1))


def test_the_layer_loop_is_decided_per_platform_unless_the_role_says():
    """Unrolled up to the platform's depth (`UNROLL_MAX_LAYERS`): a 12-layer model rolls on a CPU and
    unrolls on a GPU; `unroll_layers` set by the user wins on every platform."""
    deep = preset("tiny", num_layers=12)
    assert not deep.unrolls_layers and not deep.on_platform("cpu").unrolls_layers
    assert deep.on_platform("gpu").unrolls_layers
    assert not deep.on_platform("tpu").unrolls_layers  # not measured there: the CPU's depth
    assert not deep.replace(unroll_layers=False).on_platform("gpu").unrolls_layers
    assert preset("tiny", num_layers=40, unroll_layers=True).on_platform("cpu").unrolls_layers


def test_layers_are_stacked_on_a_leading_axis():
    model = build_model(preset("tiny", num_layers=3))
    assert model.model.layers.mlp.up[...].shape[0] == 3
    assert model.model.layers.mlp.up.get_metadata()["logical_axes"][0] == "layers"


def test_remat_policy_reads_old_booleans_and_rejects_typos():
    assert remat_policy(True) == "full" and remat_policy(False) == "none"
    with pytest.raises(ValueError, match="dots"):
        remat_policy("dot")
