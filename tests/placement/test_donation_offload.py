"""The executor does what the memory model assumes: train calls donate parameters and optimizer
state (one copy of each during a step), and roles the plan offloads wait in host memory between
their calls and come back for them device to device, with the same results."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrlhf.graph import CallGraph, CallSpec
from jaxrlhf.models.config import preset
from jaxrlhf.models.transformer import build_model
from jaxrlhf.placement.calls import CallCache
from jaxrlhf.placement.executor import Executor, Role
from jaxrlhf.planner.plan import DeviceGroup, ExecutionPlan, Layout, Placement, PlanError, validate
from jaxrlhf.transfer.realloc import is_offloaded, tree_bytes

OPT = optax.adam(1e-3)
GRAPH = CallGraph(
    (
        CallSpec("ref.inference", "ref", "inference", inputs=("tokens",), outputs=("ref_mean",)),
        CallSpec("actor.train", "actor", "train", inputs=("tokens",), outputs=("loss",)),
    ),
    feed=("tokens",),
)


def _mean_logit(graphdef, params, tokens):
    mask = jnp.ones(tokens.shape, bool)
    logits, _ = nnx.merge(graphdef, params)(tokens, jnp.cumsum(mask, 1) - 1, mask)
    return jnp.mean(logits)


def _functions(graphdef):
    def infer(params, inputs):
        return {"ref_mean": _mean_logit(graphdef, params, inputs["tokens"])}

    def train(params, opt_state, inputs):
        loss, grads = jax.value_and_grad(_mean_logit, argnums=1)(graphdef, params, inputs["tokens"])
        updates, opt_state = OPT.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss}

    return {"ref.inference": infer, "actor.train": train}


def _executor(offload: tuple[str, ...] = (), ref_layout: Layout = Layout(fsdp=4),
              offload_optimizer: tuple[str, ...] = ()) -> Executor:
    plan = ExecutionPlan(
        "test", 8, {"a": DeviceGroup("a", 0, 4), "b": DeviceGroup("b", 4, 4)},
        {"actor.train": Placement("a", Layout(fsdp=4)), "ref.inference": Placement("b", ref_layout)},
        offload_roles=offload, offload_optimizer=offload_optimizer,
    )
    validate(plan, GRAPH)
    cache = CallCache(plan)
    graphdef, state = nnx.split(build_model(preset("tiny"), seed=0))
    roles = {}
    for name in ("actor", "ref"):
        placed = cache.placed(plan.home_call(name))
        role = Role(name, graphdef, jax.device_put(state, placed.param_shardings(state)))
        if name == "actor":
            role.optimizer = OPT
            role.opt_state = jax.jit(OPT.init, out_shardings=placed.opt_state_shardings(OPT, state))(role.params)
        roles[name] = role
    return Executor(plan, GRAPH, roles, cache=cache, functions=_functions(graphdef))


FEED = {"tokens": np.arange(64, dtype=np.int32).reshape(8, 8) % 300}


def _live_bytes() -> int:
    return sum(x.nbytes for x in jax.live_arrays())


@pytest.mark.slow
def test_train_calls_donate_params_and_optimizer_state():
    ex = _executor()
    ex.step(FEED)  # compile and settle
    actor = ex.roles["actor"]
    state_bytes = tree_bytes(actor.params) + tree_bytes(actor.opt_state)
    old = jax.tree_util.tree_leaves((actor.params, actor.opt_state))
    before = _live_bytes()
    ex.step(FEED)
    jax.block_until_ready(actor.params)
    # the old buffers were donated to the update: consumed, not kept beside the new ones
    assert all(x.is_deleted() for x in old if isinstance(x, jax.Array) and x.nbytes > 64)
    assert _live_bytes() - before < 0.05 * state_bytes
    # and the compiled update writes into them: parameters and optimizer state are aliased, so a
    # step's peak is one copy of them plus its temporaries
    placed_fn = ex.function("actor.train")
    args = (actor.params, actor.opt_state, ex.place_inputs(FEED, "actor.train"))
    memory = placed_fn.compiled(*args).memory_analysis()
    per_device = state_bytes / 4  # fsdp=4 shards every large array over the group
    assert memory.alias_size_in_bytes >= 0.9 * per_device


@pytest.mark.slow
def test_offloaded_role_waits_in_host_memory_and_gives_the_same_results():
    plain, offloaded = _executor(), _executor(offload=("ref",))
    assert is_offloaded(offloaded.roles["ref"].params) and not is_offloaded(plain.roles["ref"].params)
    kinds = {x.sharding.memory_kind for x in jax.tree_util.tree_leaves(offloaded.roles["ref"].params)}
    assert kinds <= {"pinned_host", "unpinned_host"}
    for _ in range(2):
        want, got = plain.step(FEED), offloaded.step(FEED)
        np.testing.assert_allclose(got.values["ref_mean"], want.values["ref_mean"], rtol=1e-6)
        np.testing.assert_allclose(got.values["loss"], want.values["loss"], rtol=1e-6)
    # still on the host after its call; the device copy it ran on was dropped
    assert is_offloaded(offloaded.roles["ref"].params)
    assert got.times.moves["reload"] > 0 and "reload" not in want.times.moves


@pytest.mark.slow
def test_offloaded_role_reloads_without_a_host_round_trip():
    ex = _executor(offload=("ref",), ref_layout=Layout(data=2, tensor=2))
    ex.step(FEED)  # compile
    with jax.transfer_guard_device_to_host("disallow"), jax.transfer_guard_host_to_device("disallow"):
        params, temporary = ex.params_for("ref", "ref.inference")
    assert temporary and not is_offloaded(params)
    assert all(x.sharding.memory_kind == "device" for x in jax.tree_util.tree_leaves(params))


@pytest.mark.slow
def test_offloaded_optimizer_state_waits_in_host_memory_and_gives_the_same_updates():
    """`plan.offload_optimizer`: the actor's optimizer state is in host memory between steps, comes to
    device (same sharding) for actor.train and goes back after it; the updates are the plain plan's."""
    from jaxrlhf.transfer.host import host_get

    plain, parked = _executor(), _executor(offload_optimizer=("actor",))
    assert is_offloaded(parked.roles["actor"].opt_state) and not is_offloaded(plain.roles["actor"].opt_state)
    for _ in range(3):
        want, got = plain.step(FEED), parked.step(FEED)
        np.testing.assert_allclose(got.values["loss"], want.values["loss"], rtol=1e-6)
        assert is_offloaded(parked.roles["actor"].opt_state)
    for a, b in zip(jax.tree_util.tree_leaves(host_get(parked.roles["actor"].params)),
                    jax.tree_util.tree_leaves(host_get(plain.roles["actor"].params))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
    host_state = jax.tree_util.tree_leaves(parked.roles["actor"].opt_state)
    device_state = jax.tree_util.tree_leaves(plain.roles["actor"].opt_state)
    assert [x.sharding.spec for x in host_state] == [x.sharding.spec for x in device_state]
    assert {x.sharding.memory_kind for x in host_state} <= {"pinned_host", "unpinned_host"}
    assert got.times.moves["opt_reload"] > 0 and got.times.moves["opt_offload"] > 0
    assert "opt_reload" not in want.times.moves
    assert got.metrics()["time/optimizer_offload_s"] > 0
    # the params never leave the device; only the optimizer state does
    assert not is_offloaded(parked.roles["actor"].params)


def test_only_trained_roles_have_optimizer_state_to_offload():
    plan = ExecutionPlan("test", 4, {"a": DeviceGroup("a", 0, 4)},
                         {c: Placement("a", Layout(fsdp=4)) for c in GRAPH.names}, offload_optimizer=("ref",))
    with pytest.raises(PlanError, match="offload_optimizer role 'ref' has no train call"):
        validate(plan, GRAPH)
    again = ExecutionPlan.from_yaml(dataclasses.replace(plan, offload_optimizer=("actor",)).to_yaml())
    assert again.offload_optimizer == ("actor",)
    assert "optimizer state in host memory between train calls: actor" in again.table()
    assert "offload_optimizer" not in dataclasses.replace(plan, offload_optimizer=()).to_yaml()  # old files stay


def test_only_frozen_roles_can_be_offloaded():
    plan = ExecutionPlan("test", 4, {"a": DeviceGroup("a", 0, 4)},
                         {c: Placement("a", Layout(fsdp=4)) for c in GRAPH.names}, offload_roles=("actor",))
    with pytest.raises(PlanError, match="only frozen roles"):
        validate(plan, GRAPH)
    again = ExecutionPlan.from_yaml(plan.to_yaml())
    assert again.offload_roles == ("actor",)


@pytest.mark.slow
def test_a_live_switch_reshards_every_role_and_the_next_step_is_unchanged():
    """`Executor.moved_to` (a re-plan's switch): parameters and optimizer state land on their home in
    the new plan with the same values, the offloaded reference and the actor's offloaded optimizer state
    come back to device, and the next step gives what the old plan gives."""
    from jaxrlhf.transfer.host import host_get

    def values(tree):
        return [np.asarray(x) for x in jax.tree_util.tree_leaves(host_get(tree))]

    old, twin = (_executor(offload=("ref",), offload_optimizer=("actor",)) for _ in range(2))
    for ex in (old, twin):
        ex.step(FEED)
    before = {n: (values(r.params), values(r.opt_state)) for n, r in old.roles.items()}
    assert is_offloaded(old.roles["ref"].params) and is_offloaded(old.roles["actor"].opt_state)
    plan = ExecutionPlan(
        "other", 8, {"all": DeviceGroup("all", 0, 8), "a": DeviceGroup("a", 0, 4)},
        {"actor.train": Placement("all", Layout(data=2, fsdp=4)),
         "ref.inference": Placement("a", Layout(data=2, tensor=2))},
    )
    validate(plan, GRAPH)
    new = old.moved_to(plan, CallCache(plan))
    for name, role in new.roles.items():
        assert not is_offloaded(role.params), name
        target = jax.tree_util.tree_leaves(new.cache.placed(plan.home_call(name)).param_shardings(role.params))
        for x, s in zip(jax.tree_util.tree_leaves(role.params), target):
            assert x.sharding.is_equivalent_to(s, x.ndim), name
        assert all(np.array_equal(a, b) for a, b in zip(values(role.params), before[name][0])), name
        if role.trainable:
            assert not is_offloaded(role.opt_state)
            assert all(np.array_equal(a, b) for a, b in zip(values(role.opt_state), before[name][1]))
    got, ref = new.step(FEED, read=("loss", "ref_mean")), twin.step(FEED, read=("loss", "ref_mean"))
    assert float(got.values["loss"]) == pytest.approx(float(ref.values["loss"]), rel=1e-5)
    assert float(got.values["ref_mean"]) == pytest.approx(float(ref.values["ref_mean"]), rel=1e-5)
