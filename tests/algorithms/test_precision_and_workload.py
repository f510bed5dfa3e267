"""Mixed precision (fp32 master weights under bf16 parameters) and the planner workload the
runtime's own config produces."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrlhf import config as cfglib
from jaxrlhf.algorithms import build_algorithm
from jaxrlhf.algorithms.optim import build_optimizer


def _run(opt, params, grads, steps):
    state = opt.init(params)
    for _ in range(steps):
        updates, state = opt.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params, state


@pytest.mark.slow
def test_master_weights_keep_updates_that_bf16_would_lose():
    params = {"w": jnp.ones((4,), jnp.bfloat16)}
    grads = {"w": jnp.full((4,), 0.5, jnp.bfloat16)}
    kwargs = dict(lr=1e-4, total_updates=100, max_grad_norm=None)
    # bf16 has 8 bits of mantissa: a step of 1e-4 on weights of 1 rounds away every time
    plain, _ = _run(build_optimizer(**kwargs), params, grads, 100)
    assert np.all(np.asarray(plain["w"], np.float32) == 1.0)
    mixed, state = _run(build_optimizer(**kwargs, master_weights=True), params, grads, 100)
    reference, _ = _run(build_optimizer(**kwargs), {"w": jnp.ones((4,), jnp.float32)},
                        {"w": jnp.full((4,), 0.5, jnp.float32)}, 100)
    np.testing.assert_allclose(state.master["w"], reference["w"], rtol=1e-6)  # the fp32 trajectory
    assert mixed["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(mixed["w"], reference["w"].astype(jnp.bfloat16))  # params = rounded master
    moments = jax.tree_util.tree_leaves(state.inner)
    assert all(x.dtype in (jnp.float32, jnp.int32) for x in moments)


def test_workload_follows_the_runtime_config():
    cfg = cfglib.load_config(None, [
        "algorithm.name=ppo", "algorithm.micro_batch_size=4", "model.actor.remat=dots", "model.critic.remat=full",
        "optimizer.critic.master_weights=false", "data.batch_size=32", "generation.max_new_tokens=8",
    ])
    wl = build_algorithm(cfg).workload()
    assert wl.micro_batch == 4 and wl.donate
    assert (wl.remat_for("actor"), wl.remat_for("critic"), wl.remat_for("ref")) == ("dots", "full", "none")
    assert wl.master_for("actor") and not wl.master_for("critic")
    assert (wl.batch_size, wl.gen_len, wl.minibatches) == (32, 8, cfg.algorithm.minibatches)


def test_micro_batch_that_does_not_divide_a_minibatch_is_refused():
    import pytest

    with pytest.raises(cfglib.ConfigError, match=r"micro_batch_size=3 must divide a minibatch \(8 rows\)"):
        cfglib.validate(cfglib.load_config(None, ["algorithm.micro_batch_size=3", "data.batch_size=32"]))
