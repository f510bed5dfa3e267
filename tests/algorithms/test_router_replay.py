"""Router replay (`algorithm.router_replay`): the generate call records every token's experts, and the
actor's forwards route the same tokens to them with the current router's weights. Checked against a
per-token loop over the given experts, the generate forward's own routing, and the importance ratio of
the first update (1: the train call is the rollout's policy); refusals are one line naming the key."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrlhf import config as cfglib
from jaxrlhf.algorithms import AlgorithmConfigError, build_algorithm, declare, rollout, rollout_calls, update
from jaxrlhf.algorithms.rl import ROUTED
from jaxrlhf.models import moe, pipeline
from jaxrlhf.models.config import preset
from jaxrlhf.models.generation import routed_experts
from jaxrlhf.models.packing import pack_batch
from jaxrlhf.models.sampling import SamplingParams
from jaxrlhf.models.transformer import build_model


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("order, normalize", [("softmax_then_topk", True), ("softmax_then_topk", False),
                                              ("topk_then_softmax", False)])
def test_route_takes_the_given_experts_with_the_current_weights(order, normalize):
    rng = np.random.RandomState(0)
    logits = rng.randn(5, 6).astype(np.float32)
    given = np.array([[4, 1], [0, 5], [-1, -1], [2, 3], [5, 0]], np.int32)
    weights, experts = jax.device_get(moe.route(jnp.asarray(logits), 2, order, normalize, jnp.asarray(given)))
    fresh_w, fresh = jax.device_get(moe.route(jnp.asarray(logits), 2, order, normalize))
    np.testing.assert_array_equal(experts[[0, 1, 3, 4]], given[[0, 1, 3, 4]])
    np.testing.assert_array_equal(experts[2], fresh[2])  # -1: not recorded, routed afresh
    for row in (0, 1, 3, 4):  # the weights the family's order gives the given experts, by hand
        if order == "topk_then_softmax":
            want = _softmax(logits[row, given[row]])
        else:
            want = _softmax(logits[row])[given[row]]
            want = want / want.sum() if normalize else want
        np.testing.assert_allclose(weights[row], want, rtol=1e-6)
    np.testing.assert_allclose(weights[2], fresh_w[2], rtol=1e-6)
    # the router still learns: the replayed weights depend on the logits
    grad = jax.grad(lambda lg: jnp.sum(moe.route(lg, 2, order, normalize, jnp.asarray(given))[0] * jnp.arange(2.0)))(
        jnp.asarray(logits))
    assert float(jnp.abs(grad).max()) > 1e-3


def test_a_sparse_mlp_replays_against_a_per_token_loop():
    """Under `moe.replaying` a sparse MLP's output is the sum over the given experts of the current router's
    weight times the expert's gated MLP, computed here token by token in numpy."""
    cfg = preset("tiny-qwen3-moe")
    mlp = moe.SparseMLP(cfg, rngs=nnx.Rngs(params=0))
    rng = np.random.RandomState(1)
    x = rng.randn(2, 3, cfg.hidden_size).astype(np.float32)
    given = rng.randint(0, cfg.num_experts, size=(1, 2, 3, 2)).astype(np.int32)
    given[..., 1] = (given[..., 0] + 1 + rng.randint(0, cfg.num_experts - 1, size=(1, 2, 3))) % cfg.num_experts
    with moe.replaying(jnp.asarray(given)):
        y, logits = mlp(jnp.asarray(x), 0)
    router, gate, up, down = (np.asarray(p.value) for p in (mlp.router, mlp.gate, mlp.up, mlp.down))
    for b in range(2):
        for t in range(3):
            probs = _softmax(x[b, t] @ router)
            w = probs[given[0, b, t]]
            w = w / w.sum() if cfg.norm_topk_prob else w
            want = sum(wi * ((lambda g: g / (1 + np.exp(-g)))(x[b, t] @ gate[e]) * (x[b, t] @ up[e])) @ down[e]
                       for wi, e in zip(w, given[0, b, t]))
            np.testing.assert_allclose(y[b, t], want, rtol=2e-4, atol=1e-6)
    fresh, _ = mlp(jnp.asarray(x), 0)  # outside the context: the router's own top k, another output here
    assert float(jnp.abs(fresh - y).max()) > 1e-4


def _rollout(cfg, params, graphdef, engine: str):
    """A recorded rollout of 4 rows (2 prompts x 2 samples) through the runtime's generate call."""
    rng = np.random.RandomState(0)
    prompts = np.repeat(rng.randint(3, cfg.vocab_size, size=(2, 5)).astype(np.int32), 2, axis=0)
    mask = np.ones(prompts.shape, bool)
    mask[2:, :2] = False
    inputs = {"prompt_tokens": jnp.asarray(prompts), "prompt_mask": jnp.asarray(mask),
              "rng_generate": jax.random.key(3)}
    gen = functools.partial(rollout.generate_call, graphdef, SamplingParams(), 6, (1,), 0,
                            (engine, 2, 2 if engine == "continuous" else None, None), "", record_experts=True)
    return jax.jit(gen)(params, inputs)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["static", "continuous"])
def test_the_train_call_replays_the_rollouts_routing(engine):
    """Both engines record the routing their forwards made (the full forward of the finished rollout routes
    every recorded token the same way, in float32); with replay the first update's importance ratio is 1, and
    under a router that moved since the rollout the replayed forward still routes as the rollout did."""
    cfg = preset("tiny-qwen3-moe")
    graphdef, params = nnx.split(build_model(cfg, seed=0))
    out = _rollout(cfg, params, graphdef, engine)
    experts = np.asarray(out[ROUTED])
    n, layers, k = out["response_tokens"].shape[1], cfg.num_layers, cfg.num_experts_per_tok
    assert experts.shape == (4, out["tokens"].shape[1], layers, k)
    _, router = moe.forward_with_router_logits(nnx.merge(graphdef, params), out["tokens"], out["positions"],
                                               out["mask"])
    fresh = np.asarray(routed_experts(cfg, router, out["mask"]))
    recorded = experts >= 0
    np.testing.assert_array_equal(experts[recorded], fresh[recorded])
    # every real token is recorded but each row's last response token (never fed back in)
    last = np.asarray(out["mask"]).shape[1] - n + np.asarray(out["response_mask"]).sum(1) - 1
    want = np.asarray(out["mask"]).copy()
    want[np.arange(4), last] = False
    np.testing.assert_array_equal(recorded.all(axis=(2, 3)), want)

    s = rollout.RLSettings(estimator="grpo", loss="grpo", group_size=2, minibatches=1, max_new_tokens=n,
                           kl_in_reward=False, router_top_k=k, router_replay=True)
    inputs = dict(out, rule_scores=jnp.asarray([1.0, 0.0, 0.5, 0.2]), kl_coef=jnp.float32(0.0),
                  rng_actor=jax.random.key(0))
    opt = optax.sgd(0.0)
    _, _, result = jax.jit(functools.partial(rollout.actor_train, graphdef, opt, s))(params, opt.init(params), inputs)
    stats = result["actor_stats"]
    assert abs(float(stats["ratio/mean"]) - 1) < 1e-5 and abs(float(stats["ratio/max"]) - 1) < 1e-5, stats

    # a router moved since the rollout (as after an update): its own top k differs from the recorded experts
    # on some tokens, but the replayed forward's log-probs are those of the recorded routing
    moved = _moved_router(params)
    _, moved_router = moe.forward_with_router_logits(nnx.merge(graphdef, moved), out["tokens"], out["positions"],
                                                     out["mask"])
    moved_fresh = np.asarray(routed_experts(cfg, moved_router, out["mask"]))
    assert np.any(moved_fresh[recorded] != experts[recorded])
    logp = functools.partial(rollout.policy_logprobs, graphdef, SamplingParams(), None, output="old_logp",
                             replay=True)
    replayed = logp(moved, out)["old_logp"]
    unreplayed = logp(moved, {k_: v for k_, v in out.items() if k_ != ROUTED})["old_logp"]
    with moe.replaying(jnp.moveaxis(jnp.asarray(np.where(recorded, experts, moved_fresh)), 2, 0)):
        by_hand, _ = nnx.merge(graphdef, moved)(out["tokens"], out["positions"], out["mask"])
    p = out["tokens"].shape[1] - n
    from jaxrlhf.models.sampling import token_logprobs
    want = jnp.where(out["response_mask"], token_logprobs(by_hand[:, p - 1:-1], out["response_tokens"],
                                                         SamplingParams()), 0.0)
    np.testing.assert_allclose(replayed, want, atol=1e-5)
    assert float(jnp.abs(replayed - unreplayed).max()) > 1e-4


def _moved_router(params):
    """The actor's router after it moved (as after an update): its own top k differs from the rollout's."""
    moved = jax.tree_util.tree_map(lambda x: x, params)
    mlp = moved["model"]["layers"]["mlp"]
    mlp["router"].value = mlp["router"].value + 0.5 * jax.random.normal(jax.random.key(7), mlp["router"].value.shape)
    return moved


@pytest.mark.slow
def test_packed_calls_replay_as_the_padded_ones():
    """`algorithm.pack_sequences` with router replay: the recorded experts are packed beside the tokens, and
    the packed train call (two budgeted micro-batches) and the actor's packed log-probs equal the padded
    ones under a router that moved since the rollout; the reference's log-probs ignore them."""
    cfg = preset("tiny-qwen3-moe")
    graphdef, params = nnx.split(build_model(cfg, seed=0))
    out = jax.device_get(_rollout(cfg, params, graphdef, "static"))
    moved = _moved_router(params)
    n = out["response_tokens"].shape[1]
    s = rollout.RLSettings(estimator="grpo", loss="grpo", group_size=2, minibatches=2, max_new_tokens=n,
                           kl_in_reward=False, router_top_k=cfg.num_experts_per_tok, router_replay=True)
    inputs = dict(out, rule_scores=np.asarray([1.0, 0.0, 0.5, 0.2], np.float32), kl_coef=np.float32(0.0),
                  rng_actor=jax.random.key(0))
    updates = np.asarray(update.minibatch_indices(inputs["rng_actor"], 4, 2, 1))
    packed, _ = pack_batch(out["mask"], out["tokens"], out["positions"], n, updates, shards=1, budget=12,
                           experts=out[ROUTED])
    assert packed["experts"].shape[-2:] == (cfg.num_layers, cfg.num_experts_per_tok) and packed["tokens"].shape[2] == 2
    opt = optax.sgd(0.1)
    train = jax.jit(functools.partial(rollout.actor_train, graphdef, opt, s))
    padded = train(moved, opt.init(moved), inputs)
    by_packing = train(moved, opt.init(moved), {**{k: v for k, v in inputs.items() if k != ROUTED},
                                                "packed_actor": packed})
    for key in ("loss/policy", "ratio/mean", "ratio/max", "entropy"):  # (the balancing loss is per micro-batch)
        np.testing.assert_allclose(by_packing[2]["actor_stats"][key], padded[2]["actor_stats"][key], rtol=1e-5)
    np.testing.assert_allclose(jax.tree_util.tree_leaves(by_packing[0])[0], jax.tree_util.tree_leaves(padded[0])[0],
                               atol=1e-6)
    inference, _ = pack_batch(out["mask"], out["tokens"], out["positions"], n, np.arange(4)[None], shards=1,
                              experts=out[ROUTED])
    logp = functools.partial(rollout.policy_logprobs, graphdef, SamplingParams(), None, output="old_logp")
    packed_in = {k: out[k] for k in ("response_tokens", "response_mask")} | {"packed_inference": inference}
    replayed = logp(moved, packed_in, replay=True)["old_logp"]
    np.testing.assert_allclose(replayed, logp(moved, out, replay=True)["old_logp"], atol=1e-5)
    own = logp(moved, packed_in)["old_logp"]  # the reference's: its own routing
    np.testing.assert_allclose(own, logp(moved, {k: v for k, v in out.items() if k != ROUTED})["old_logp"], atol=1e-5)
    assert float(jnp.abs(replayed - own).max()) > 1e-4


def _config(*overrides):
    return cfglib.load_config(None, ["algorithm.name=grpo", "algorithm.group_size=2", "sft.steps=0",
                                     "algorithm.router_replay=true", *overrides])


def test_router_replay_refusals():
    algorithm = build_algorithm(_config("model.actor.preset=tiny"))
    algorithm.model_configs = {"actor": preset("tiny")}
    with pytest.raises(AlgorithmConfigError, match=r"algorithm.router_replay=true .* has no experts .* "
                                                   r"set algorithm.router_replay=false"):
        algorithm.settings()
    # a pipelined train or inference call: refused before any forward (so no model is needed to see it)
    batch = {"tokens": jnp.ones((2, 4), jnp.int32), "positions": jnp.zeros((2, 4), jnp.int32),
             "mask": jnp.ones((2, 4), bool), ROUTED: jnp.zeros((2, 4, 2, 2), jnp.int8)}
    with pipeline.staged(2), pytest.raises(AlgorithmConfigError, match="pipelined .* layout with stage=1"):
        rollout_calls.response_hidden(None, batch, 2)  # the forward that reads response positions
    with pytest.raises(cfglib.ConfigError, match="set generation.partial_rollout=false"):
        _config("generation.engine=continuous", "generation.partial_rollout=true")


def test_the_recorded_experts_travel_with_the_batch():
    """In the graph from the generate call through `trim_responses` to the actor's train and inference calls
    (not the reference's or the critic's); cut with the batch's sequences."""
    graph = declare(_config("model.actor.preset=tiny-qwen3-moe", "generation.max_new_tokens=16",
                            "algorithm.rollout_correction=tis", "algorithm.kl_coef=0.01")).graph()
    calls = {c.name: c for c in graph.calls}
    assert "full_" + ROUTED in calls["actor.generate"].outputs
    trim = next(h for h in graph.host_steps if h.name == "trim_responses")
    assert "full_" + ROUTED in trim.inputs and ROUTED in trim.outputs
    assert ROUTED in calls["actor.train"].inputs and ROUTED in calls["actor.inference"].inputs
    assert ROUTED not in calls["ref.inference"].inputs
    b, p, n = 2, 3, 16
    mask = np.zeros((b, n), bool)
    mask[0, :5] = True
    experts = np.arange(b * (p + n) * 2 * 2).reshape(b, p + n, 2, 2).astype(np.int8)
    batch = {"tokens": np.zeros((b, p + n), np.int32), "response_mask": mask, ROUTED: experts}
    cut = rollout.trim_responses(batch, n)
    assert cut["tokens"].shape == (b, p + 8)
    np.testing.assert_array_equal(cut[ROUTED], experts[:, :p + 8])
    # packed calls: the packing carries them (packed as the tokens), not the train call's padded inputs
    graph = declare(_config("model.actor.preset=tiny-qwen3-moe", "algorithm.pack_sequences=true",
                            "algorithm.rollout_correction=tis")).graph()
    calls = {c.name: c for c in graph.calls}
    pack = next(h for h in graph.host_steps if h.name == "pack_sequences")
    assert ROUTED in pack.inputs and ROUTED not in calls["actor.train"].inputs
    assert ROUTED not in calls["actor.inference"].inputs and "packed_inference" in calls["actor.inference"].inputs
