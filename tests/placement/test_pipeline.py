"""Pipeline parallelism changes placement, not math: staged train and inference calls equal the
unpipelined ones; layers (only) are split over stages; generation refuses to be pipelined."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxrlhf.algorithms import rollout
from jaxrlhf.models import pipeline
from jaxrlhf.models.sampling import SamplingParams
from jaxrlhf.models.transformer import KVCache, build_model, positions_from_mask
from jaxrlhf.placement.calls import CallCache
from jaxrlhf.placement.executor import Executor
from jaxrlhf.planner.plan import DeviceGroup, ExecutionPlan, Layout, Placement, PlanError
from jaxrlhf.testing.graphs import ppo_graph
from jaxrlhf.testing.models import random_model, tiny_config

B, PROMPT, NEW = 16, 4, 5
CONFIG = tiny_config(num_layers=4)
# stage x data x fsdp x tensor on 8 devices, and the call's micro-batch size (rows): M = rows / micro-batch
STAGED = {
    "2 stages, data2 x fsdp2, M=2": (Layout(stage=2, data=2, fsdp=2), 4),
    "4 stages, data2, M=2": (Layout(stage=4, data=2), 4),
    "2 stages, data2 x tensor2, M=1": (Layout(stage=2, data=2, tensor=2), None),
}


def _inputs() -> dict[str, jax.Array]:
    rng = np.random.RandomState(0)
    tokens = rng.randint(3, CONFIG.vocab_size, size=(B, PROMPT + NEW)).astype(np.int32)
    mask = np.ones((B, PROMPT + NEW), bool)
    mask[:5, :2] = False  # left padding
    response_mask = np.arange(NEW)[None, :] < rng.randint(1, NEW + 1, size=B)[:, None]
    mask[:, PROMPT:] = response_mask
    return {
        "tokens": tokens, "mask": mask, "positions": np.asarray(positions_from_mask(jnp.asarray(mask))),
        "response_tokens": tokens[:, PROMPT:], "response_mask": response_mask,
        "behaviour_logp": -rng.uniform(1, 6, size=(B, NEW)).astype(np.float32),
        "rule_scores": rng.uniform(-1, 1, size=B).astype(np.float32),
        "ended_with_eos": rng.uniform(size=B) > 0.3, "kl_coef": np.float32(0.05),
    }


@pytest.fixture(scope="module")
def actor():
    """4-layer tiny actor: graphdef (layer body rematerialised, so remat runs inside the pipeline) and host params."""
    _, params = nnx.split(random_model(CONFIG))
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: build_model(CONFIG, remat="full")))
    return graphdef, jax.tree_util.tree_map(np.asarray, params)


def _settings(micro_batch: int | None) -> rollout.RLSettings:
    return rollout.RLSettings(estimator="reinforce_pp", minibatches=2, micro_batch=micro_batch, max_new_tokens=NEW,
                              ratio_early_stop=None)


OPT = optax.sgd(0.1)  # Adam would blow float-noise-sized gradient differences up to full-size steps


def _placed_call(layout: Layout, call: str, fn, host_params, inputs):
    """`fn` compiled on `layout` over all 8 devices, with parameters and inputs placed there."""
    plan = ExecutionPlan("test", 8, {"all": DeviceGroup("all", 0, 8)}, {call: Placement("all", layout)})
    cache = CallCache(plan)
    placed = cache.placed(call)
    params = jax.device_put(host_params, placed.param_shardings(host_params))
    args = {k: jax.device_put(v, placed.batch_sharding(np.ndim(v)) if np.ndim(v) else placed.replicated())
            for k, v in inputs.items()}
    return cache.function(call, fn, in_shardings=None, out_shardings=None), placed, params, args


@pytest.fixture(scope="module")
def reference(actor):
    """The unpipelined calls (one device): inference log-probs and one train call's parameters and stats."""
    graphdef, host = actor
    inputs = {k: jnp.asarray(v) for k, v in _inputs().items()}
    logp = jax.jit(functools.partial(rollout.policy_logprobs, graphdef, SamplingParams(), 4))(host, inputs)["ref_logp"]
    train = jax.jit(functools.partial(rollout.actor_train, graphdef, OPT, _settings(4)))
    params, _, out = train(host, OPT.init(host), {**inputs, "rng_actor": jax.random.key(1)})
    return np.asarray(logp), params, out["actor_stats"]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(STAGED))
def test_pipelined_inference_equals_unpipelined(case, actor, reference):
    graphdef, host = actor
    layout, micro = STAGED[case]
    fn = functools.partial(rollout.policy_logprobs, graphdef, SamplingParams(), micro)
    call, placed, params, args = _placed_call(layout, "ref.inference", fn, host, _inputs())
    assert placed.stages == layout.stage
    np.testing.assert_allclose(np.asarray(call(params, args)["ref_logp"]), reference[0], rtol=1e-5, atol=1e-5)
    # The stage shift is a collective permute between stage devices.
    assert "collective-permute" in call.compiled(params, args).as_text()


# 4 stages here; 2-stage train calls (actor and critic) run in tests/algorithms/test_pipeline_ppo.py.
@pytest.mark.slow
@pytest.mark.parametrize("case", list(STAGED)[1:2])
def test_pipelined_train_call_equals_unpipelined(case, actor, reference):
    graphdef, host = actor
    layout, micro = STAGED[case]
    fn = functools.partial(rollout.actor_train, graphdef, OPT, _settings(micro))
    call, placed, params, args = _placed_call(layout, "actor.train", fn, host, _inputs())
    opt_state = jax.jit(OPT.init, out_shardings=placed.opt_state_shardings(OPT, params))(params)
    args["rng_actor"] = jax.device_put(jax.random.key(1), placed.replicated())
    new, _, out = call(params, opt_state, args)
    _, want, want_stats = reference
    changed = 0
    for got, w, before in zip(jax.tree_util.tree_leaves(new), jax.tree_util.tree_leaves(want),
                              jax.tree_util.tree_leaves(host)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(w), rtol=1e-5, atol=2e-6)
        changed += not np.allclose(np.asarray(w), before)
    assert changed  # the update did something
    for key in ("loss/policy", "entropy", "clipfrac", "grad_norm", "advantages/mean"):
        np.testing.assert_allclose(out["actor_stats"][key], want_stats[key], rtol=2e-4, atol=1e-6)
    # Trained layers stay split over the stages; the embedding is replicated over them.
    assert new["model"]["layers"]["mlp"]["up"].sharding.spec[0] == "stage"
    assert "stage" not in jax.tree_util.tree_leaves(new["model"]["embed"].sharding.spec)


def test_layers_split_into_consecutive_stage_blocks(actor):
    _, host = actor
    plan = ExecutionPlan("t", 8, {"all": DeviceGroup("all", 0, 8)},
                         {"actor.train": Placement("all", Layout(stage=4, fsdp=2))})
    specs = CallCache(plan).placed("actor.train").param_shardings(host)
    assert specs["model"]["layers"]["attn"]["q"].spec == P("stage", "fsdp")
    assert specs["model"]["embed"].spec == P(None, "fsdp")
    assert specs["model"]["final_norm"]["weight"].spec == P("fsdp")
    placed = jax.device_put(host["model"]["layers"]["attn"]["q"], specs["model"]["layers"]["attn"]["q"])
    for shard in placed.addressable_shards:  # stage s holds layers s*L/S .. (s+1)*L/S - 1
        assert shard.index[0] == slice(shard.device.id // 2, shard.device.id // 2 + 1)


def test_generation_is_never_pipelined(actor):
    graphdef, host = actor
    model = nnx.merge(graphdef, host)
    tokens = jnp.ones((2, 3), jnp.int32)
    mask = jnp.ones((2, 3), bool)
    with pipeline.staged(2), pytest.raises(ValueError, match="generation .* is never pipelined"):
        model(tokens, positions_from_mask(mask), mask, cache=KVCache.init(CONFIG, 2, 8))
    graph = ppo_graph()
    layout = Layout(stage=2, data=4)
    plan = ExecutionPlan("t", 8, {"all": DeviceGroup("all", 0, 8)}, {c: Placement("all", layout) for c in graph.names})
    functions = {c.name: None for c in graph.calls}
    host_steps = {h.name: None for h in graph.host_steps}
    with pytest.raises(PlanError, match="'actor.generate': generation is never pipelined; give it a layout with stage"):
        Executor(plan, graph, {}, cache=CallCache(plan), functions=functions, host_steps=host_steps)
