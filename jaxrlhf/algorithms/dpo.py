"""DPO (Rafailov et al. 2023) and IPO (Azar et al. 2023): preference optimisation without a reward model.

x = (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l)), log-probs
summed over the response tokens. DPO: -(1 - ls) log sigmoid(beta x) - ls log
sigmoid(-beta x) (`algorithm.dpo_label_smoothing` = ls; 0 is plain DPO, > 0 the
conservative cDPO of OpenRLHF and TRL <= 0.28). IPO: (x' - 1 / (2 beta))^2 with
x' built from log-probs averaged over each response's length (TRL, as the IPO
authors confirmed; OpenRLHF sums). Implicit rewards beta (log pi - log pi_ref)
and their accuracy (chosen > rejected, strictly) are logged every step and,
with `run.eval_every`, on `data.eval_split`.

The stage is declared in `jaxrlhf.algorithms.stages`; this is its runtime. The step graph: `ref.inference` (reference log-probs of both responses, on
the reference's placement) then `actor.train`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxrlhf.algorithms.pairs import pair_arrays, pair_logprobs
from jaxrlhf.algorithms.stages import PAIR, REF
from jaxrlhf.algorithms.update import loss_aux, map_microbatches, minibatch_updates



def dpo_loss(
    logp: jax.Array, ref_logp: jax.Array, lengths: jax.Array, *, beta: float, label_smoothing: float, kind: str
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Loss over pairs from [2, B] summed log-probs (chosen row 0, rejected row 1) and response lengths."""
    ratio = logp - ref_logp
    rewards = beta * jax.lax.stop_gradient(ratio)
    if kind == "ipo":
        per_token = ratio / jnp.maximum(lengths, 1.0)
        losses = jnp.square(per_token[0] - per_token[1] - 1.0 / (2.0 * beta))
    else:
        x = beta * (ratio[0] - ratio[1])
        losses = -(1.0 - label_smoothing) * jax.nn.log_sigmoid(x) - label_smoothing * jax.nn.log_sigmoid(-x)
    loss = jnp.mean(losses)
    stats = {
        "loss/dpo": loss,
        "rewards/chosen": jnp.mean(rewards[0]),
        "rewards/rejected": jnp.mean(rewards[1]),
        "rewards/margin": jnp.mean(rewards[0] - rewards[1]),
        "rewards/accuracy": jnp.mean((rewards[0] > rewards[1]).astype(jnp.float32)),
        "logps/chosen": jnp.mean(jax.lax.stop_gradient(logp[0])),
        "logps/rejected": jnp.mean(jax.lax.stop_gradient(logp[1])),
    }
    return loss, jax.lax.stop_gradient(stats)


def named_pair_logprobs(
    names: tuple[str, str], graphdef: nnx.GraphDef, micro_batch: int | None, params: nnx.State,
    inputs: dict[str, Any],
) -> dict[str, jax.Array]:
    """Summed response log-probs of the chosen and rejected sequences, under `names`."""
    def one(b):
        logp, _ = pair_logprobs(graphdef, params, b)
        return dict(zip(names, (logp[0], logp[1])))

    return map_microbatches(one, inputs, micro_batch)


ref_pair_logprobs = functools.partial(named_pair_logprobs, REF)
policy_pair_logprobs = functools.partial(named_pair_logprobs, ("chosen", "rejected"))


def dpo_train(
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    beta: float,
    label_smoothing: float,
    kind: str,
    micro_batch: int | None,
    params: nnx.State,
    opt_state: Any,
    inputs: dict[str, Any],
) -> tuple[nnx.State, Any, dict[str, Any]]:
    """One DPO (or IPO) update of the actor."""
    data = {k: inputs[k] for k in (*PAIR, *REF)}

    def loss_fn(params, mb):
        logp, lengths = pair_logprobs(graphdef, params, mb)
        ref = jnp.stack([mb["ref_chosen_logp"], mb["ref_rejected_logp"]])
        loss, stats = dpo_loss(logp, ref, lengths, beta=beta, label_smoothing=label_smoothing, kind=kind)
        return loss, loss_aux(stats, mb["chosen_tokens"].shape[0])

    params, opt_state, stats = minibatch_updates(loss_fn, optimizer, params, opt_state, data, inputs["rng_actor"],
                                                 micro_batch=micro_batch)
    return params, opt_state, {"actor_stats": stats}


class DPORuntime:
    """The runtime half of the `dpo` stage (declared in jaxrlhf.algorithms.stages)."""

    def functions(self) -> dict[str, Any]:
        alg, m = self.cfg.algorithm, self.models
        return {
            "ref.inference": functools.partial(ref_pair_logprobs, m["ref"].graphdef, alg.micro_batch_size),
            "actor.train": functools.partial(dpo_train, m["actor"].graphdef, m["actor"].optimizer, alg.dpo_beta,
                                             alg.dpo_label_smoothing, alg.dpo_loss, alg.micro_batch_size),
        }

    def dataset(self, tokenizer: Any, split: str | None = None) -> Any:
        from jaxrlhf.data import PreferenceDataset

        return PreferenceDataset.from_config(self.cfg, tokenizer, split=split)

    def feed(self, batch: Any, rng: jax.Array) -> dict[str, Any]:
        return {**pair_arrays(batch), "rng_actor": rng}

    def metric_values(self) -> tuple[str, ...]:
        return ("actor_stats",)

    def metrics(self, result: Any) -> dict[str, float]:
        v = result.values
        out = {k: float(x) for k, x in jax.device_get(v["actor_stats"]).items()}
        tokens = float(np.sum(v["chosen_mask"]) + np.sum(v["rejected_mask"]))
        out["throughput/tokens_per_s"] = tokens / max(result.seconds, 1e-9)
        return out

    def evaluate(self, executor: Any) -> dict[str, float]:
        """Implicit-reward accuracy and margin on the held-out pairs."""
        if not self.cfg.data.eval_split:
            return {}
        beta = self.cfg.algorithm.dpo_beta
        right = margin = total = 0.0
        for batch, weight in self.dataset(self.tokenizer, split=self.cfg.data.eval_split).single_pass():
            inputs = pair_arrays(batch)
            ref = jax.device_get(executor.run_at("ref.inference", self._eval_fns[0], inputs))
            pol = jax.device_get(executor.run_at("actor.train", self._eval_fns[1], inputs))
            r_c = beta * (pol["chosen"] - ref["ref_chosen_logp"])
            r_r = beta * (pol["rejected"] - ref["ref_rejected_logp"])
            right += float(np.sum((r_c > r_r) * weight))
            margin += float(np.sum((r_c - r_r) * weight))
            total += float(np.sum(weight))
        return {"eval/rewards_accuracy": right / max(total, 1.0), "eval/rewards_margin": margin / max(total, 1.0)}

    @functools.cached_property
    def _eval_fns(self) -> tuple[Any, Any]:
        micro = self.cfg.algorithm.micro_batch_size
        return (functools.partial(ref_pair_logprobs, self.models["ref"].graphdef, micro),
                functools.partial(policy_pair_logprobs, self.models["actor"].graphdef, micro))
