"""Reward modelling: a scalar head trained on preference pairs (Bradley-Terry, InstructGPT).

Loss: -log sigmoid(r_chosen - r_rejected), averaged over pairs (TRL's
RewardTrainer, OpenRLHF, ReaLHF). The score is read at the last real token
(the EOS that ends the response). Accuracy is the fraction of pairs with
r_chosen > r_rejected strictly (ties count as wrong); with `run.eval_every`
it is measured on `data.eval_split`. The trained model is exported as an HF
checkpoint (`reward_hf/`, `score.weight` [1, hidden] as
LlamaForSequenceClassification) that `model.reward.path` + `rewards.model`
load for RL. The score's bias gets no gradient from a pairwise loss, so it
stays 0 and the export loses nothing.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxrlhf.algorithms.pairs import pair_arrays, pair_scores
from jaxrlhf.algorithms.stages import PAIR
from jaxrlhf.algorithms.update import loss_aux, map_microbatches, minibatch_updates


def pairwise_loss(chosen: jax.Array, rejected: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """-log sigmoid(r_c - r_r) averaged over pairs, and its stats."""
    margin = chosen - rejected
    loss = -jnp.mean(jax.nn.log_sigmoid(margin))
    stats = {
        "loss/rm": loss, "rm/accuracy": jnp.mean((margin > 0).astype(jnp.float32)), "rm/margin": jnp.mean(margin),
        "rm/chosen_mean": jnp.mean(chosen), "rm/rejected_mean": jnp.mean(rejected),
    }
    return loss, jax.lax.stop_gradient(stats)


def rm_train(
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    micro_batch: int | None,
    params: nnx.State,
    opt_state: Any,
    inputs: dict[str, Any],
) -> tuple[nnx.State, Any, dict[str, Any]]:
    """One pairwise update of the reward model."""
    data = {k: inputs[k] for k in PAIR}

    def loss_fn(params, mb):
        loss, stats = pairwise_loss(*pair_scores(graphdef, params, mb))
        return loss, loss_aux(stats, mb["chosen_tokens"].shape[0])

    params, opt_state, stats = minibatch_updates(loss_fn, optimizer, params, opt_state, data, inputs["rng_reward"],
                                                 micro_batch=micro_batch)
    return params, opt_state, {"reward_stats": stats}


def rm_eval(
    graphdef: nnx.GraphDef, micro_batch: int | None, params: nnx.State, inputs: dict[str, Any]
) -> dict[str, jax.Array]:
    def one(b):
        chosen, rejected = pair_scores(graphdef, params, b)
        return {"chosen": chosen, "rejected": rejected}

    return map_microbatches(one, inputs, micro_batch)


class RewardModellingRuntime:
    """The runtime half of the `rm` stage (declared in jaxrlhf.algorithms.stages)."""

    def functions(self) -> dict[str, Any]:
        reward = self.models["reward"]
        return {"reward.train": functools.partial(rm_train, reward.graphdef, reward.optimizer,
                                                  self.execution.micro_batch("reward.train"))}

    def dataset(self, tokenizer: Any, split: str | None = None) -> Any:
        from jaxrlhf.data import PreferenceDataset

        return PreferenceDataset.from_config(self.cfg, tokenizer, split=split)

    def feed(self, batch: Any, rng: jax.Array) -> dict[str, Any]:
        return {**pair_arrays(batch), "rng_reward": rng}

    def metric_values(self) -> tuple[str, ...]:
        return ("reward_stats",)

    def metrics(self, result: Any) -> dict[str, float]:
        v = result.values
        stats = jax.device_get(v["reward_stats"])
        out = {k: float(x) for k, x in stats.items()}
        tokens = float(np.sum(v["chosen_mask"]) + np.sum(v["rejected_mask"]))
        out["throughput/tokens_per_s"] = tokens / max(result.seconds, 1e-9)
        return out

    def evaluate(self, executor: Any) -> dict[str, float]:
        """Pair accuracy (strict r_chosen > r_rejected) on the held-out split."""
        if not self.cfg.data.eval_split:
            return {}
        right = total = 0.0
        for batch, weight in self.dataset(self.tokenizer, split=self.cfg.data.eval_split).single_pass():
            out = jax.device_get(executor.run_at("reward.train", self._eval_fn, pair_arrays(batch)))
            right += float(np.sum((out["chosen"] > out["rejected"]) * weight))
            total += float(np.sum(weight))
        return {"eval/rm_accuracy": right / max(total, 1.0)}

    @functools.cached_property
    def _eval_fn(self) -> Any:
        return functools.partial(rm_eval, self.models["reward"].graphdef, self.cfg.algorithm.micro_batch_size)
