"""The train calls of RL from rollouts, and the rewards and advantages they compute from the batch.

Both train calls compute the rewards and advantages from the same inputs (`rollout_advantages`), so nothing
has to travel between their device groups. Scores are shaped inside them too: (rule + model score - bias) x
scale, clipped, and zero for responses that did not end with EOS; then the overlong penalty.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jaxtyping import Array, Float

from jaxrlhf.algorithms.advantages import ADVANTAGE_ESTIMATORS, AdvantageBatch
from jaxrlhf.algorithms.correction import behaviour_logp, correction_weights
from jaxrlhf.algorithms.kl import kl_per_token, token_level_rewards
from jaxrlhf.algorithms.losses import aggregation_weight, get_loss, importance_ratio_exploded, value_loss
from jaxrlhf.algorithms.rewards import overlong_penalty, shape_scores
from jaxrlhf.algorithms.rollout_calls import (
    RLSettings,
    _response_slice,
    packed_output,
    response_hidden,
    response_token_stats,
)
from jaxrlhf.algorithms.stats import RunningMoments, masked_mean, masked_whiten
from jaxrlhf.algorithms.update import loss_aux, minibatch_updates
from jaxrlhf.environments.base import ACTION_MASK
from jaxrlhf.models.moe import forward_with_router_logits, load_balancing_loss, router_statistics
from jaxrlhf.rollouts import ROUTED


def shaped_scores(inputs: dict[str, Any], s: RLSettings, prefix: str = "") -> Float[Array, " batch"]:
    """Rule plus reward-model score, then bias/scale, clip and the EOS gate; then the overlong
    penalty (outside the gate and the clip: a truncated response is the one it must reach)."""
    ended = inputs[f"{prefix}ended_with_eos"]
    raw = jnp.zeros(ended.shape, jnp.float32)
    for name in ("rule_scores", "model_scores", "env_reward"):  # env_reward: an episode's (`env.name`)
        if prefix + name in inputs:
            raw = raw + inputs[prefix + name].astype(jnp.float32)
    shaped = shape_scores(raw, ended, bias=s.reward_bias, scale=s.reward_scale, clip=s.reward_clip,
                          eos_only=s.eos_only)
    if s.overlong_buffer:
        lengths = jnp.sum(inputs[f"{prefix}response_mask"].astype(jnp.int32), axis=-1)
        shaped = shaped + overlong_penalty(lengths, max_len=s.max_new_tokens, buffer=s.overlong_buffer,
                                           penalty=s.overlong_penalty)
    return shaped


def model_tokens(inputs: dict[str, Any]) -> jax.Array:
    """The response tokens the policy sampled, the ones the RL math counts: `response_mask`, less a multi-turn
    trajectory's observation tokens (its `action_mask`, when the batch has one)."""
    return inputs.get(ACTION_MASK, inputs["response_mask"])


def rollout_advantages(
    inputs: dict[str, Any], s: RLSettings, kl_coef: Float[Array, ""], moments: RunningMoments | None
) -> tuple[Float[Array, "batch new"], Float[Array, "batch new"], Float[Array, "batch new"], Float[Array, " batch"]]:
    """(advantages, returns in reward units, per-token KL, shaped scores): identical wherever it runs."""
    mask = model_tokens(inputs).astype(jnp.float32)
    if "ref_logp" in inputs:
        kl = kl_per_token(inputs["behaviour_logp"], inputs["ref_logp"], mask, kind=s.kl_estimator)
    else:
        kl = jnp.zeros_like(mask)
    scores = shaped_scores(inputs, s)
    rewards = token_level_rewards(scores, mask, kl if s.kl_in_reward else None, kl_coef)
    batch = AdvantageBatch(rewards, mask)
    if "values" in inputs:
        values = inputs["values"]
        if s.normalize_values and moments is not None:
            values = moments.denormalize(values)
        batch = batch.replace(values=values * mask)
    if "greedy_ended_with_eos" in inputs:
        batch = batch.replace(baseline_rewards=shaped_scores(inputs, s, prefix="greedy_"))
    estimator = ADVANTAGE_ESTIMATORS.get(s.estimator)
    hparams = {"gamma": s.gamma, "lam": s.lam, "group_size": s.group_size, "scale_by_std": s.norm_adv_by_std}
    adv, returns = estimator(batch, **hparams)
    if estimator.whitening == "optional" and s.whiten:
        adv = masked_whiten(adv, mask)
    return adv, returns, kl, scores



# ---------------------------------------------------------------- train calls


def actor_train(
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    s: RLSettings,
    params: nnx.State,
    opt_state: Any,
    inputs: dict[str, Any],
) -> tuple[nnx.State, Any, dict[str, Any]]:
    """Clipped policy-gradient update over the rollouts; returns params, optimizer state, stats and advantages.

    With a rollout correction (`s.correction`) the ratio is taken against the recomputed `old_logp`, and
    the correction's token weights and loss mask (from `old_logp` against `behaviour_logp`) enter the loss;
    without one against `behaviour_logp`, as sampled."""
    correction = s.correction
    if correction.active:
        behaviour_logp(inputs, correction.kind)  # one line naming the key when the rollout has none
    kl_coef = inputs["kl_coef"].astype(jnp.float32)
    adv, _, kl, scores = rollout_advantages(inputs, s, kl_coef, inputs.get("value_moments"))
    loss_impl = get_loss(s.loss)
    packed = inputs.get("packed_actor")
    p = 0 if packed is not None else inputs["tokens"].shape[1] - inputs["response_tokens"].shape[1]
    loss_kwargs: dict[str, Any] = {"clip_eps": s.clip_eps, "clip_eps_high": s.clip_eps_high,
                                   "entropy_coef": s.entropy_coef, "agg": s.loss_agg, "norm_len": s.max_new_tokens}
    if s.kl_in_loss:
        loss_kwargs.update(kl_coef=kl_coef, kl_kind=s.kl_estimator)

    def loss_fn(params, mb):
        model = nnx.merge(graphdef, params)
        if s.router_top_k:  # a mixture of experts: its router logits too, for the balancing loss and statistics
            hidden, router = forward_with_router_logits(functools.partial(response_hidden, model), mb, p)
        else:
            hidden = response_hidden(model, mb, p)
        logp, ent = response_token_stats(model, hidden, mb, s.sampling, s.logit_chunk)
        logp = jnp.where(mb["response_mask"], logp, 0.0)
        mask = mb.get("loss_mask", model_tokens(mb))  # a correction's mask: no sequences it dropped
        weights = {"token_weights": mb["is_weight"]} if "is_weight" in mb else {}
        # a packed micro-batch's empty slots are no rows (Dr. GRPO's normaliser counts rows)
        rows = jnp.sum(mb["row_valid"].astype(jnp.float32)) if "row_valid" in mb else None
        loss, stats = loss_impl(
            logp, mb["old_logp"], mb["adv"], mask, ref_logp=mb.get("ref_logp"), entropy=ent,
            **loss_kwargs, **weights, rows=rows,
        )
        if "entropy" not in stats:
            stats["entropy"] = masked_mean(jax.lax.stop_gradient(ent), mask)
        exploded = (
            importance_ratio_exploded(logp, mb["old_logp"], mask, s.ratio_early_stop)
            if s.ratio_early_stop is not None
            else jnp.array(False)
        )
        if s.router_top_k:
            real = mb["packed"]["segments"] > 0 if "packed" in mb else mb["mask"]
            balance = load_balancing_loss(router, s.router_top_k, real)
            load = router_statistics(jax.lax.stop_gradient(router), s.router_top_k, real)["load"]
            loss = loss + s.router_aux_coef * balance
            experts = load.shape[-1]
            stats.update({"router/aux_loss": jax.lax.stop_gradient(balance),
                          "router/load_max": jnp.max(load) * experts, "router/load_min": jnp.min(load) * experts})
        weight = aggregation_weight(mask, s.loss_agg, rows)
        tokens = aggregation_weight(mask)
        return loss, loss_aux(stats, weight, jax.lax.stop_gradient(exploded), stats_weight=tokens)

    data = {
        "response_tokens": inputs["response_tokens"], "response_mask": inputs["response_mask"],
        "old_logp": inputs["behaviour_logp"], "adv": adv,
    }
    if packed is None:
        data.update(tokens=inputs["tokens"], mask=inputs["mask"], positions=inputs["positions"])
    if ACTION_MASK in inputs:  # a multi-turn batch: its observation tokens carry no loss
        data[ACTION_MASK] = inputs[ACTION_MASK]
    if ROUTED in inputs and packed is None:  # router replay (packed: in the packing, as the tokens)
        data[ROUTED] = inputs[ROUTED]
    correction_stats: dict[str, Any] = {}
    if correction.active:
        weights, loss_mask, correction_stats = correction_weights(
            correction, inputs["old_logp"], inputs["behaviour_logp"], model_tokens(inputs))
        data.update(old_logp=inputs["old_logp"], loss_mask=loss_mask)
        if weights is not None:
            data["is_weight"] = weights
    if "ref_logp" in inputs:
        data["ref_logp"] = inputs["ref_logp"]
    params, opt_state, stats = minibatch_updates(
        loss_fn, optimizer, params, opt_state, data, inputs["rng_actor"], minibatches=s.minibatches,
        epochs=s.epochs, micro_batch=s.micro_batch, early_stop=s.ratio_early_stop is not None, packed=packed,
    )
    mask = model_tokens(inputs).astype(jnp.float32)
    stats["kl/mean"] = jnp.mean(jnp.sum(kl * mask, axis=1))  # per-sequence KL, averaged
    stats["kl/token_mean"] = masked_mean(kl, mask)
    stats["kl/coef"] = kl_coef
    stats["advantages/mean"] = masked_mean(adv, mask)
    stats["reward/mean"] = jnp.mean(scores)
    stats.update(correction_stats)
    return params, opt_state, {"actor_stats": stats, "advantages": adv}


def critic_train(
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    s: RLSettings,
    params: nnx.State,
    opt_state: Any,
    inputs: dict[str, Any],
) -> tuple[nnx.State, Any, dict[str, Any]]:
    """Clipped value regression onto the GAE returns; updates the value-normalisation moments."""
    moments = inputs["value_moments"]
    _, returns, _, _ = rollout_advantages(inputs, s, inputs["kl_coef"].astype(jnp.float32), moments)
    mask = model_tokens(inputs).astype(jnp.float32)
    if s.normalize_values:
        moments = moments.update(returns, mask)
        returns = moments.normalize(returns)
    packed = inputs.get("packed_critic")

    def loss_fn(params, mb):
        model = nnx.merge(graphdef, params)
        if packed is not None:
            v = packed_output(model, mb)
        else:
            p = mb["tokens"].shape[1] - mb["response_mask"].shape[1]
            v = _response_slice(model(mb["tokens"], mb["positions"], mb["mask"]), p)
        loss, stats = value_loss(v, mb["old_values"], mb["returns"], model_tokens(mb), clip_eps=s.value_clip_eps)
        return loss, loss_aux(stats, aggregation_weight(model_tokens(mb)))

    data = {"response_mask": inputs["response_mask"], "old_values": inputs["values"], "returns": returns}
    if ACTION_MASK in inputs:  # a multi-turn batch: observation tokens are no value targets
        data[ACTION_MASK] = inputs[ACTION_MASK]
    if packed is None:
        data.update(tokens=inputs["tokens"], mask=inputs["mask"], positions=inputs["positions"])
    params, opt_state, stats = minibatch_updates(
        loss_fn, optimizer, params, opt_state, data, inputs["rng_critic"], minibatches=s.minibatches,
        epochs=s.epochs, micro_batch=s.micro_batch, packed=packed,
    )
    stats = {f"critic/{k}" if not k.startswith(("loss/", "value/")) else k: v for k, v in stats.items()}
    stats["returns/mean"] = masked_mean(returns, mask)
    return params, opt_state, {"critic_stats": stats, "value_moments": moments}
