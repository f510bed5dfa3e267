"""Calls bound to placements: the same train step under every preset, compile cache, async dispatch."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrlhf.models.config import preset
from jaxrlhf.models.transformer import build_model, positions_from_mask
from jaxrlhf.placement.calls import CallCache
from jaxrlhf.planner.plan import DeviceGroup, ExecutionPlan, Layout, Placement
from jaxrlhf.planner.presets import STRATEGIES, build_plan
from jaxrlhf.testing.graphs import ppo_graph

PPO_GRAPH = ppo_graph()
ROLES = PPO_GRAPH.roles

TINY = {r: preset("tiny") for r in ROLES}
BATCH, LENGTH = 8, 12
# eps well above float32 reduction noise: Adam divides by |grad|, so with eps=1e-8 the order in which a
# layout sums a near-zero gradient would decide a whole step's sign for that element.
OPT = optax.adamw(1e-2, eps=1e-5, weight_decay=0.01)


@pytest.fixture(scope="module")
def actor():
    graphdef, state = nnx.split(build_model(preset("tiny"), seed=0))
    host = jax.tree_util.tree_map(np.asarray, state)
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 384, size=(BATCH, LENGTH), dtype=np.int32)
    mask = np.ones((BATCH, LENGTH), bool)
    mask[:3, :4] = False  # some left padding
    return graphdef, host, tokens, mask


def make_train_step(graphdef):
    def train_step(params, opt_state, tokens, mask):
        def loss_fn(p):
            model = nnx.merge(graphdef, p)
            logits, _ = model(tokens[:, :-1], positions_from_mask(mask)[:, :-1], mask[:, :-1])
            logp = jax.nn.log_softmax(logits, axis=-1)
            nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
            w = mask[:, 1:].astype(jnp.float32)
            return (nll * w).sum() / w.sum()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = OPT.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def run_step(plan, call, actor, out=None):
    graphdef, host, tokens, mask = actor
    cache = CallCache(plan)
    placed = cache.placed(call)
    ps, os = placed.param_shardings(host), placed.opt_state_shardings(OPT, host)
    bs = placed.batch_sharding(2)
    params = jax.device_put(host, ps)
    opt_state = jax.jit(OPT.init, out_shardings=os)(params)
    step = cache.function(
        call, make_train_step(graphdef),
        in_shardings=(ps, os, bs, bs), out_shardings=(ps, os, placed.replicated()), donate_argnums=(0, 1),
    )
    new_params, new_opt_state, loss = step(params, opt_state, jax.device_put(tokens, bs), jax.device_put(mask, bs))
    leaves = jax.tree_util.tree_leaves(new_params)
    assert all(x.sharding.mesh == placed.mesh for x in leaves)
    if out is not None:
        out.update(params=new_params, opt_state=new_opt_state, placed=placed)
    return [np.asarray(x) for x in leaves], float(loss)


@pytest.fixture(scope="module")
def colocated_result(actor):
    return run_step(build_plan("colocated", 8, TINY, PPO_GRAPH, batch_size=BATCH), "actor.train", actor)


CASES = [(s, "actor.train") for s in sorted(STRATEGIES) if s != "colocated"] + [("reallocated", "actor.generate")]


@pytest.mark.slow
@pytest.mark.parametrize("strategy,call", CASES, ids=[f"{s}:{c}" for s, c in CASES])
def test_train_step_under_each_preset_matches_colocated(strategy, call, actor, colocated_result):
    plan = build_plan(strategy, 8, TINY, PPO_GRAPH, batch_size=BATCH)
    want, want_loss = colocated_result
    got, loss = run_step(plan, call, actor)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6, atol=1e-6)
    before = jax.tree_util.tree_leaves(actor[1])
    assert any(not np.allclose(a, b) for a, b in zip(want, before))  # the step changed something
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_optimizer_state_split_over_data_replicas_gives_the_colocated_step(actor, colocated_result):
    """ZeRO-1: on data x fsdp x tensor each device holds 1/data of the Adam moments its parameter shard
    mirrors, and the step (update on slices, parameters all-gathered) is the colocated one."""
    plan = ExecutionPlan("zero1", 8, {"all": DeviceGroup("all", 0, 8)},
                         {c: Placement("all", Layout(data=4, tensor=2)) for c in PPO_GRAPH.names})
    out = {}
    got, loss = run_step(plan, "actor.train", actor, out)
    want, want_loss = colocated_result
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6, atol=1e-6)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=0)
    params = jax.tree_util.tree_leaves(out["params"])
    mu = jax.tree_util.tree_leaves(out["opt_state"][0].mu)
    split = 0
    for p, m in zip(params, mu):
        assert "data" not in str(p.sharding.spec)  # parameters stay replicated over data
        shard = lambda x: x.addressable_shards[0].data.size  # noqa: E731
        split += shard(m) * 4 == shard(p)
    assert split >= len(params) - 1  # every moment but an odd-sized one holds a quarter of its parameter shard


@pytest.mark.slow
def test_a_train_call_left_to_the_compiler_returns_its_state_laid_out_as_it_came(actor):
    """The executor's train calls give no shardings (they follow the committed arguments): the new parameters
    come out as they went in, not pulled into the ZeRO-1 split of the optimizer state they were updated from."""
    graphdef, host, tokens, mask = actor
    plan = ExecutionPlan("zero1", 8, {"all": DeviceGroup("all", 0, 8)},
                         {c: Placement("all", Layout(data=4, tensor=2)) for c in PPO_GRAPH.names})
    cache = CallCache(plan)
    placed = cache.placed("actor.train")
    params = jax.device_put(host, placed.param_shardings(host))
    opt_state = jax.jit(OPT.init, out_shardings=placed.opt_state_shardings(OPT, host))(params)
    want = jax.tree_util.tree_map(lambda x: x.sharding, (params, opt_state))
    step = cache.function("actor.train", make_train_step(graphdef), in_shardings=None, out_shardings=None,
                          donate_argnums=(0, 1), kind="train")
    bs = placed.batch_sharding(2)
    new_params, new_opt_state, _ = step(params, opt_state, jax.device_put(tokens, bs), jax.device_put(mask, bs))
    got = jax.tree_util.tree_map(lambda x: x.sharding, (new_params, new_opt_state))
    assert jax.tree_util.tree_leaves(got) == jax.tree_util.tree_leaves(want)
    assert any("data" in str(s.spec) for s in jax.tree_util.tree_leaves(got[1]))


def test_compiled_once_per_shape_bucket_and_dispatched_without_host_sync():
    plan = build_plan("interleaved", 8, TINY, PPO_GRAPH, batch_size=BATCH)
    cache = CallCache(plan)
    a, c = cache.placed("actor.train"), cache.placed("critic.train")
    assert not plan.group_of("actor.train").overlaps(plan.group_of("critic.train"))

    def work(x):
        return jnp.tanh(x @ x.T).sum(axis=1)

    fa = cache.function("actor.train", work, in_shardings=a.batch_sharding(2), out_shardings=a.batch_sharding(1))
    fc = cache.function("critic.train", work, in_shardings=c.batch_sharding(2), out_shardings=c.batch_sharding(1))
    assert cache.function("actor.train", work, in_shardings=None, out_shardings=None) is fa
    xa = jax.device_put(jnp.ones((8, 8)), a.batch_sharding(2))
    xc = jax.device_put(jnp.ones((8, 8)), c.batch_sharding(2))
    fa(xa), fc(xc)  # compile outside the guard
    with jax.transfer_guard("disallow"):  # dispatch only: no value comes to host in between
        ya = fa(xa)
        yc = fc(xc)
    np.testing.assert_allclose(np.asarray(ya), np.asarray(yc))
    assert fa.num_compiled == 1
    fa(jax.device_put(jnp.ones((8, 32)), a.batch_sharding(2)))  # another shape: a second compile
    assert fa.num_compiled == 2 and cache.num_compiled == 3
    assert set(ya.sharding.device_set).isdisjoint(yc.sharding.device_set)


def test_compile_options_by_kind_and_device_count(monkeypatch):
    """One device per process: train and inference calls compile without YNNPACK's one-thread dot
    fusions, generate calls keep them; with several devices every call keeps XLA's defaults."""
    from jaxrlhf.placement import calls

    ynn_off = {"xla_cpu_experimental_ynn_fusion_type": ""}
    assert jax.local_device_count("cpu") == 8
    assert all(calls.compiler_options(k, "cpu") == {} for k in ("train", "inference", "generate"))
    monkeypatch.setattr(calls.jax, "local_device_count", lambda platform=None: 1)
    assert calls.compiler_options("train", "cpu") == ynn_off
    assert calls.compiler_options("inference", "cpu") == ynn_off
    assert calls.compiler_options("generate", "cpu") == {}
    assert calls.compiler_options("train", "gpu") == {}


def test_compile_lowered_applies_options_and_skips_unknown_ones():
    from jaxrlhf.placement.calls import compile_lowered

    x = jnp.ones((64, 64))
    lowered = jax.jit(lambda a: jnp.tanh(a @ a)).lower(x)
    default = compile_lowered(lowered, {})
    off = compile_lowered(lowered, {"xla_cpu_experimental_ynn_fusion_type": ""})
    if "ynn" in default.as_text():  # a jaxlib with YNNPACK fusions: the option reached XLA
        assert "ynn" not in off.as_text()
    unknown = compile_lowered(lowered, {"xla_cpu_no_such_option_here": True})  # an older or newer jaxlib
    np.testing.assert_allclose(unknown(x), default(x))
    np.testing.assert_allclose(off(x), default(x), rtol=1e-6)
