"""A mixture-of-experts actor in the RL update: `algorithm.router_aux_loss_coef` adds the load-balancing
loss (logged with the router's load), only it moves the update, and a dense actor refuses the key."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrlhf import config as cfglib
from jaxrlhf.algorithms import AlgorithmConfigError, build_algorithm, rollout
from jaxrlhf.models.config import preset
from jaxrlhf.models.moe import forward_with_router_logits, load_balancing_loss
from jaxrlhf.models.transformer import build_model, positions_from_mask


@pytest.mark.slow
def test_the_balancing_loss_joins_the_update_and_is_logged():
    cfg = preset("tiny-qwen3-moe")
    graphdef, params = nnx.split(build_model(cfg, seed=0))
    rng = np.random.RandomState(0)
    b, p, n = 4, 4, 6
    mask = np.ones((b, p + n), bool)
    mask[:, p:] = np.arange(n)[None, :] < np.array([6, 2, 4, 1])[:, None]
    tokens = np.where(mask, rng.randint(3, cfg.vocab_size, size=mask.shape), 0).astype(np.int32)
    inputs = {"tokens": jnp.asarray(tokens), "mask": jnp.asarray(mask),
              "positions": positions_from_mask(jnp.asarray(mask)), "response_tokens": jnp.asarray(tokens[:, p:]),
              "response_mask": jnp.asarray(mask[:, p:]), "behaviour_logp": jnp.full((b, n), -2.0),
              "rule_scores": jnp.asarray([1.0, 0.0, 0.5, 0.2]), "ended_with_eos": jnp.ones(b, bool),
              "kl_coef": jnp.float32(0.0), "rng_actor": jax.random.key(0)}
    opt = optax.sgd(1.0)
    runs = {}
    for coef in (0.0, 0.5):
        s = rollout.RLSettings(estimator="grpo", loss="grpo", group_size=2, minibatches=1, max_new_tokens=n,
                               kl_in_reward=False, router_aux_coef=coef, router_top_k=cfg.num_experts_per_tok)
        runs[coef] = jax.jit(functools.partial(rollout.actor_train, graphdef, opt, s))(params, opt.init(params), inputs)
    _, router = forward_with_router_logits(nnx.merge(graphdef, params), inputs["tokens"], inputs["positions"],
                                           inputs["mask"])
    want = load_balancing_loss(router, cfg.num_experts_per_tok, inputs["mask"])
    for coef, (_, _, out) in runs.items():
        stats = out["actor_stats"]
        np.testing.assert_allclose(stats["router/aux_loss"], want, rtol=1e-5)
        assert stats["router/load_max"] >= 1.0 >= stats["router/load_min"] >= 0.0
    moved = runs[0.5][0]["model"]["layers"]["mlp"]["router"].value - runs[0.0][0]["model"]["layers"]["mlp"]["router"].value
    assert float(jnp.abs(moved).max()) > 0  # the balancing loss reaches the router
    # the policy loss itself is the same with and without it
    np.testing.assert_allclose(runs[0.5][2]["actor_stats"]["loss/policy"], runs[0.0][2]["actor_stats"]["loss/policy"],
                               rtol=1e-6)


def test_a_dense_actor_refuses_the_balancing_loss():
    cfg = cfglib.load_config(None, ["model.actor.preset=tiny", "algorithm.name=grpo", "algorithm.group_size=2",
                                    "algorithm.router_aux_loss_coef=0.01", "sft.steps=0"])
    algorithm = build_algorithm(cfg)
    algorithm.model_configs = {"actor": preset("tiny")}
    with pytest.raises(AlgorithmConfigError, match="algorithm.router_aux_loss_coef=0.01 .* has no experts"):
        algorithm.settings()
