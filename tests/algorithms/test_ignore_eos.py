"""`generation.ignore_eos`: the rollout samples every response to max_new_tokens, past EOS (evaluation
still stops there), and a config that would then score nothing is refused."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrlhf import config as cfglib
from jaxrlhf.algorithms import build_algorithm
from jaxrlhf.models.config import preset
from jaxrlhf.models.tokenizer import load_tokenizer
from jaxrlhf.models.transformer import build_model
from jaxrlhf.placement.executor import Role

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NEW = 8


def _eos_model(eos_id: int):
    """A tiny model that puts nearly all probability on EOS at every position: every token embeds to
    ones, the layers add nothing to the residual stream, and only the EOS column of the head is set."""
    graphdef, params = nnx.split(build_model(preset("tiny"), seed=0))
    flat = dict(nnx.to_flat_state(params))

    def put(path, fn):
        flat[path] = flat[path].replace(fn(flat[path].value))

    put(("model", "embed"), jnp.ones_like)
    put(("model", "layers", "attn", "o"), jnp.zeros_like)
    put(("model", "layers", "mlp", "down"), jnp.zeros_like)
    put(("lm_head",), lambda w: jnp.zeros_like(w).at[:, eos_id].set(1.0))
    return graphdef, nnx.from_flat_state(flat)


def _generate(*overrides):
    cfg = cfglib.load_config(os.path.join(ROOT, "configs", "quickstart-grpo.yaml"), [
        "sft.steps=0", "data.batch_size=2", "algorithm.group_size=2", f"generation.max_new_tokens={NEW}",
        "rewards.eos_only=false", *overrides])
    algorithm = build_algorithm(cfg)
    tok = load_tokenizer("byte")
    graphdef, params = _eos_model(tok.eos_id)
    algorithm.bind(tok, {"actor": Role("actor", graphdef, params)})
    prompts = np.full((4, 4), 10, np.int32)
    inputs = {"prompt_tokens": jnp.asarray(prompts), "prompt_mask": jnp.ones((4, 4), bool),
              "rng_generate": jax.random.key(0)}
    out = algorithm.functions()["actor.generate"](params, inputs)
    return {k.removeprefix(algorithm.generated_prefix): np.asarray(v) for k, v in out.items()}, tok


@pytest.mark.parametrize("engine", ["static", "continuous"])
def test_responses_run_past_eos_to_max_new_tokens(engine):
    stops, tok = _generate(f"generation.engine={engine}")
    assert (stops["response_tokens"][:, 0] == tok.eos_id).all()  # the model says EOS first ...
    np.testing.assert_array_equal(stops["response_mask"].sum(axis=1), 1)  # ... and the rollout stops there
    assert stops["ended_with_eos"].all()

    full, _ = _generate(f"generation.engine={engine}", "generation.ignore_eos=true")
    np.testing.assert_array_equal(full["response_mask"].sum(axis=1), NEW)  # every token sampled and trained on
    assert (full["response_tokens"] == tok.eos_id).all()
    assert not full["ended_with_eos"].any()  # cut at the cap, as a response that never said EOS


def test_ignore_eos_needs_rewards_that_score_responses_without_eos():
    with pytest.raises(cfglib.ConfigError, match="set rewards.eos_only=false"):
        build_algorithm(cfglib.load_config(os.path.join(ROOT, "configs", "quickstart-grpo.yaml"),
                                           ["generation.ignore_eos=true", "rewards.eos_only=true"]))
