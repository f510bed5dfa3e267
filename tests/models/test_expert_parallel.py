"""Expert parallelism: a mixture of experts' logits and gradients through a placed jit with the experts split
over 2, 4 and 8 devices (beside data, FSDP and tensor parallelism) against the single-device dense dispatch;
the `expert` axis of layouts, meshes, plan files and plan validation; a reallocation between a layout with and
one without it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrlhf.models import axes as ax
from jaxrlhf.models.config import PRESETS
from jaxrlhf.placement.calls import CallCache
from jaxrlhf.placement.layout import activation_resolver, make_mesh, param_specs
from jaxrlhf.planner.plan import (
    DeviceGroup, ExecutionPlan, Layout, Placement, PlanError, layout_misfit, validate,
)
from jaxrlhf.testing.graphs import ppo_graph
from jaxrlhf.testing.models import random_model

# Qwen2-MoE: 8 experts, top 2, and a shared expert every token goes through (not split over the axis)
CFG = PRESETS["tiny-qwen2-moe"]
B, T = 8, 12


def _batch():
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, CFG.vocab_size, size=(B, T), dtype=np.int32)
    mask = np.ones((B, T), bool)
    mask[1, :3] = False  # left padding
    mask[5, -4:] = False  # right padding
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    return tokens, positions, mask


def _loss_and_grad(graphdef):
    def run(params, tokens, positions, mask):
        def loss(p):
            logits, _ = nnx.merge(graphdef, p)(tokens, positions, mask)
            return jnp.sum(jnp.where(mask[..., None], logits, 0.0) ** 2) / 100.0, logits

        (_, logits), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return logits, grads

    return run


@pytest.fixture(scope="module")
def model():
    graphdef, params = nnx.split(random_model(CFG, seed=0))
    batch = _batch()
    logits, grads = jax.jit(_loss_and_grad(graphdef))(params, *batch)  # dense dispatch, one device
    return graphdef, params, batch, np.asarray(logits), [np.asarray(g) for g in jax.tree_util.tree_leaves(grads)]


# expert parallelism on 2, 4 and 8 devices: alone, beside tensor parallelism (each local expert's MLP split
# too), beside FSDP (expert weights split over both) and the batch over 8 devices
LAYOUTS = [Layout(expert=2), Layout(tensor=2, expert=2), Layout(fsdp=2, expert=4)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_model_logits_and_gradients_match_the_single_device_dispatch(model, layout):
    graphdef, params, batch, want_logits, want_grads = model
    plan = ExecutionPlan("test", 8, {"g": DeviceGroup("g", 0, layout.num_devices)},
                         {"actor.train": Placement("g", layout)})
    cache = CallCache(plan)
    placed = cache.placed("actor.train")
    assert placed.mesh.shape["expert"] == layout.expert
    ps, bs = placed.param_shardings(params), placed.batch_sharding(2)
    gate = nnx.to_flat_state(ps)
    gate = next(s for path, s in gate if path[-1] == "gate")
    assert gate.spec[1] == "expert"  # [layers, expert, embed, mlp]: each device holds num_experts / e experts
    fn = cache.function("actor.train", _loss_and_grad(graphdef), in_shardings=(ps, bs, bs, bs), out_shardings=None)
    logits, grads = fn(jax.device_put(params, ps), *(jax.device_put(x, bs) for x in batch))
    np.testing.assert_allclose(np.asarray(logits), want_logits, atol=2e-5, rtol=0)
    got = [np.asarray(g) for g in jax.tree_util.tree_leaves(grads)]
    assert len(got) == len(want_grads)
    scale = max(np.abs(g).max() for g in want_grads)
    for g, w in zip(got, want_grads):
        np.testing.assert_allclose(g, w, atol=1e-5 * scale, rtol=0)
