"""RL from rollouts: the calls and host steps PPO, GRPO, RLOO, REINFORCE++ and ReMax share.

The algorithms are declared (roles, graph, config rules) in `jaxrlhf.algorithms.rl`, without
JAX; `RolloutRuntime` here is their runtime half. The step graph (bracketed parts depend on the algorithm and the config):

    feed   prompt_tokens, prompt_mask, prompts, answers, rng_generate, rng_actor[, rng_critic]
    state  kl_coef[, value_moments]

    actor.generate           prompts -> tokens, mask, positions, response_tokens, response_mask,
                             behaviour_logp, ended_with_eos
    [actor.generate_greedy]  the same prompts decoded greedily -> greedy_* (ReMax's baseline)
    [trim_responses]         host: the batch cut to its longest response (`generation.trim_responses`;
                             the generate call's outputs are then named full_*)
    [score_rules]            host: decoded responses + reference answers -> rule_scores[, greedy_rule_scores]
    [reward.inference]       reward-model scores -> model_scores[, greedy_model_scores]
    [actor.inference]        the trainer's log-probs of the response before its update -> old_logp
                             (`algorithm.rollout_correction` other than none; `jaxrlhf.algorithms.correction`)
    [ref.inference]          reference log-probs of the response -> ref_logp
    [critic.inference]       values of every response token -> values
    actor.train              policy update -> actor_stats, advantages
    [critic.train]           value update -> critic_stats, value_moments (carried)
    [kl_control]             host: adaptive KL coefficient -> kl_coef (carried)

Conventions for a batch of sequences [B, L] = left-padded prompt (P tokens)
followed by the response (N tokens, right-padded): the logits at position
P-1+t predict response token t, and the critic's value at the same position
is V(s_t), the value of the state *before* response token t.

Both train calls compute the rewards and advantages from the same inputs
(`rollout_advantages`), so nothing has to travel between their device
groups. Scores are shaped inside them too: (rule + model score - bias) x
scale, clipped, and zero for responses that did not end with EOS.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jaxtyping import Array, Float, Int

from jaxrlhf.algorithms.advantages import ADVANTAGE_ESTIMATORS, AdvantageBatch
from jaxrlhf.algorithms.correction import Correction, behaviour_logp, correction_weights
from jaxrlhf.environments import ACTION_MASK, EpisodeTiming
from jaxrlhf.algorithms.evaluation import pass_at_k
from jaxrlhf.algorithms.kl import adaptive_kl_coef, kl_per_token, token_level_rewards
from jaxrlhf.algorithms.losses import aggregation_weight, get_loss, importance_ratio_exploded, value_loss
from jaxrlhf.algorithms.base import AlgorithmConfigError
from jaxrlhf.algorithms.rl import RESPONSE, ROUTED, SEQUENCE
from jaxrlhf.config_schema import AGENT_ENVIRONMENT
from jaxrlhf.algorithms.rewards import overlong_penalty, shape_scores
from jaxrlhf.rewards.rules import CombinedReward
from jaxrlhf.algorithms.stats import RunningMoments, masked_mean, masked_whiten
from jaxrlhf.models.packing import pack_batch
from jaxrlhf.algorithms.update import loss_aux, map_microbatches, map_packed, minibatch_indices, minibatch_updates
from jaxrlhf.models.engines import GENERATION_ENGINES
from jaxrlhf.models import pipeline
from jaxrlhf.models.lengths import lognormal_lengths, response_width
from jaxrlhf.models.moe import forward_with_router_logits, load_balancing_loss, replaying, router_statistics
from jaxrlhf.models.sampling import SamplingParams, entropy, token_logprobs



@dataclasses.dataclass(frozen=True)
class RLSettings:
    """Static settings of the rollout calls (hashable: part of every compile key)."""

    estimator: str
    loss: str = "ppo"
    group_size: int = 1
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std: bool = True
    whiten: bool = False  # only for estimators whose whitening is optional (GAE)
    clip_eps: float = 0.2
    clip_eps_high: float | None = None  # None = clip_eps (symmetric); DAPO decouples them
    value_clip_eps: float | None = 0.2
    kl_estimator: str = "k1"
    kl_in_reward: bool = True
    kl_in_loss: bool = False
    loss_agg: str = "token-mean"
    max_new_tokens: int = 32
    minibatches: int = 4
    epochs: int = 1
    micro_batch: int | None = None  # rows per micro-batch in train and inference calls
    ratio_early_stop: float | None = 5.0
    normalize_values: bool = False
    entropy_coef: float = 0.0
    sampling: SamplingParams = SamplingParams()
    reward_bias: float = 0.0
    reward_scale: float = 1.0
    reward_clip: float | None = 20.0
    eos_only: bool = True
    overlong_buffer: int = 0  # DAPO's soft overlong punishment over the last N tokens; 0 = off
    overlong_penalty: float = 1.0
    ignore_eos: bool = False  # generation.ignore_eos: responses run to max_new_tokens past any EOS
    engine: str = "static"  # generation.engine (models/engines.py)
    slots: int | None = None  # generation.slots (continuous engine)
    kv_pages: int | None = None  # generation.kv_pages (continuous engine)
    correction: Correction = Correction()  # algorithm.rollout_correction and its parameters
    # a mixture-of-experts actor: the load-balancing loss's weight (algorithm.router_aux_loss_coef) and the
    # experts per token; experts = 0 for a dense actor (no router statistics)
    router_aux_coef: float = 0.0
    router_top_k: int = 0
    router_replay: bool = False  # algorithm.router_replay: the generate call records experts, the actor replays them


def _response_slice(x: jax.Array, prompt_len: int) -> jax.Array:
    """Outputs at positions P-1 .. L-2: the ones that predict (or value) response tokens."""
    return x[:, prompt_len - 1 : -1]


def packed_output(model: nnx.Module, batch: dict[str, Any], at: str = "read") -> jax.Array:
    """A model's outputs on a packed micro-batch (`update.packed_micro_batch`), read at the positions
    `at` names ("read": those that predict each response token, [slots, N, ...]; "last": each
    sequence's last token, [slots, ...])."""
    pk = batch["packed"]
    out = model(pk["tokens"], pk["positions"], pk["segments"] > 0, segment_ids=pk["segments"], read_at=pk[at])
    return out[0] if isinstance(out, tuple) else out


def response_logits(model: nnx.Module, batch: dict[str, Any], prompt_len: int) -> Float[Array, "batch new vocab"]:
    """The logits that predict the response tokens, computed for those positions only (the prompt's
    full-vocabulary logits are never built); from packed rows when the batch is packed, and then only
    where a real response token is predicted ([reads, vocab], `packing`'s `take`: `response_targets` are
    the tokens they predict, `on_response_grid` puts per-token results back). A batch holding
    the rollout's experts (`ROUTED`, router replay) routes every token to them (`moe.replaying`)."""
    if "packed" in batch:  # [s, P] read as [s, 1, P]: rows of the matmul-shaped [s, P, vocab]
        pk = batch["packed"]
        with replaying(_replayed(pk.get("experts"))):  # packed rows' experts, packed as their tokens
            logits = packed_output(model, {"packed": {**pk, "take": pk["take"][:, None]}}, "take")
        return logits.reshape(-1, logits.shape[-1])
    with replaying(_replayed(batch.get(ROUTED))):
        logits, _ = model(batch["tokens"], batch["positions"], batch["mask"], logits_from=prompt_len - 1)
    return logits[:, :-1]


def _replayed(experts: jax.Array | None) -> jax.Array | None:
    """Recorded experts [rows, length, layers, k] as `moe.replaying` takes them ([layers, rows, length, k])."""
    if experts is None:
        return None
    if pipeline.is_pipelined():  # a pipeline splits the batch inside the forward
        raise AlgorithmConfigError(
            "algorithm.router_replay=true replays each row's experts in one forward, but this call's placement is "
            "pipelined (stage > 1): give the actor's train and inference calls a layout with stage=1 (or set "
            "algorithm.router_replay=false)")
    return jnp.moveaxis(experts, 2, 0)


def response_targets(batch: dict[str, Any]) -> Int[Array, "..."]:
    """The tokens `response_logits` predict: the response grid, or a packed batch's taken ones."""
    if "packed" not in batch:
        return batch["response_tokens"]
    return jnp.take(batch["response_tokens"].reshape(-1), batch["packed"]["take_from"], mode="fill", fill_value=0)


def on_response_grid(batch: dict[str, Any], values: Float[Array, "..."]) -> Float[Array, "batch new"]:
    """Per-token `values` at `response_logits`' positions on the [batch, new] response grid (a packed
    batch's cells that hold no real response token: 0)."""
    if "packed" not in batch:
        return values
    rows, new = batch["response_tokens"].shape
    flat = jnp.zeros(rows * new, values.dtype).at[batch["packed"]["take_from"]].set(values, mode="drop")
    return flat.reshape(rows, new)



# ---------------------------------------------------------------- generate and inference calls


def generate_call(
    graphdef: nnx.GraphDef,
    sampling: SamplingParams,
    max_new_tokens: int,
    eos_id: int | tuple[int, ...] | None,
    pad_id: int,
    engine: tuple[str, int, int | None, int | None],
    prefix: str,
    params: nnx.State,
    inputs: dict[str, Any],
    *,
    record_experts: bool = False,
) -> dict[str, jax.Array]:
    """Sample responses to the prompts (KV cache, on-device decode loop); outputs named with `prefix`;
    with `record_experts` (router replay) also every token's experts (`ROUTED`).
    A response ends on any of the ids in `eos_id`. `engine` = (name, group_size, slots, kv_pages): the prompts
    come in groups of `group_size` adjacent copies (`repeat_rows`), which the continuous engine prefills once.
    `inputs["max_lengths"]` (optional): each response's own cap (`generation.simulated_lengths`)."""
    name, group_size, slots, kv_pages = engine
    out = GENERATION_ENGINES[name](
        graphdef, params, inputs["prompt_tokens"], inputs["prompt_mask"], inputs["rng_generate"],
        max_new_tokens=max_new_tokens, sampling=sampling, eos_id=eos_id, pad_id=pad_id,
        group_size=group_size, slots=slots, kv_pages=kv_pages, max_lengths=inputs.get("max_lengths"),
        **({"record_experts": True} if record_experts else {}),
    )
    values = {
        "tokens": out.tokens, "mask": out.mask, "positions": out.positions, "response_tokens": out.response_tokens,
        "response_mask": out.response_mask, "behaviour_logp": out.logprobs, "ended_with_eos": out.ended_with_eos,
    }
    if record_experts:
        values[ROUTED] = out.experts
    return {prefix + k: v for k, v in values.items()}


def policy_logprobs(
    graphdef: nnx.GraphDef, sampling: SamplingParams, micro_batch: int | None, params: nnx.State,
    inputs: dict[str, Any], *, output: str = "ref_logp", replay: bool = False,
) -> dict[str, Float[Array, "batch new"]]:
    """Log-probs of the response under a policy, same logits processing as sampling, named `output`: the
    reference model's (`ref_logp`), or the actor's before its update (`old_logp`, a rollout correction's).
    `replay` (the actor's, under router replay): its forward routes the tokens to the rollout's experts; the
    reference routes its own way even where a shared packing carries them."""
    model = nnx.merge(graphdef, params)
    if not replay:
        inputs = {k: v for k, v in inputs.items() if k != ROUTED}
        if "packed_inference" in inputs:
            inputs["packed_inference"] = {k: v for k, v in inputs["packed_inference"].items() if k != "experts"}
    packed = inputs.get("packed_inference")
    p = 0 if packed is not None else inputs["tokens"].shape[1] - inputs["response_tokens"].shape[1]

    def one(b):
        logp = token_logprobs(response_logits(model, b, p), response_targets(b), sampling)
        return {output: jnp.where(b["response_mask"], on_response_grid(b, logp), 0.0)}

    if packed is not None:
        return map_packed(one, {k: inputs[k] for k in RESPONSE}, packed)
    return map_microbatches(one, inputs, micro_batch)


def critic_values(
    graphdef: nnx.GraphDef, micro_batch: int | None, params: nnx.State, inputs: dict[str, Any]
) -> dict[str, jax.Array]:
    """V(s_t) for every response token (0 on padding). GAE does not bootstrap past the last token (see
    `advantages.gae`), so the output there is not read."""
    model = nnx.merge(graphdef, params)
    packed = inputs.get("packed_inference")

    def one(b):
        response_mask = b["response_mask"]
        if packed is not None:
            return {"values": jnp.where(response_mask, packed_output(model, b), 0.0)}
        tokens = b["tokens"]
        v = model(tokens, b["positions"], b["mask"])
        p = tokens.shape[1] - response_mask.shape[1]
        return {"values": jnp.where(response_mask, _response_slice(v, p), 0.0)}

    if packed is not None:
        return map_packed(one, {"response_mask": inputs["response_mask"]}, packed)
    return map_microbatches(one, inputs, micro_batch)


def reward_scores(
    graphdef: nnx.GraphDef, prefixes: tuple[str, ...], micro_batch: int | None, params: nnx.State,
    inputs: dict[str, Any],
) -> dict[str, Float[Array, "batch"]]:
    """Reward-model score of each sequence (read at its last real token), for every prefix's sequences."""
    model = nnx.merge(graphdef, params)
    packed = inputs.get("packed_inference")
    if packed is not None:  # one batch (no greedy baseline's): read at each sequence's last token
        rows = {"ended_with_eos": inputs["ended_with_eos"]}
        return map_packed(lambda b: {"model_scores": packed_output(model, b, "last")}, rows, packed)

    def one(b):
        return {f"{p}model_scores": model(b[f"{p}tokens"], b[f"{p}positions"], b[f"{p}mask"]) for p in prefixes}

    return map_microbatches(one, inputs, micro_batch)


# ---------------------------------------------------------------- rewards and advantages


def shaped_scores(inputs: dict[str, Any], s: RLSettings, prefix: str = "") -> Float[Array, "batch"]:
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
) -> tuple[Float[Array, "batch new"], Float[Array, "batch new"], Float[Array, "batch new"], Float[Array, "batch"]]:
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
            logits, router = forward_with_router_logits(functools.partial(response_logits, model), mb, p)
        else:
            logits = response_logits(model, mb, p)
        logp = on_response_grid(mb, token_logprobs(logits, response_targets(mb), s.sampling))
        logp = jnp.where(mb["response_mask"], logp, 0.0)
        ent = on_response_grid(mb, entropy(logits, s.sampling))
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


# ---------------------------------------------------------------- host steps


def decode_responses(tokenizer: Any, tokens: np.ndarray, mask: np.ndarray) -> list[str]:
    """Response text of every row (padding and every EOS id dropped)."""
    eos = set(tokenizer.eos_ids)
    return [tokenizer.decode([int(t) for t, m in zip(row, mrow) if m and t not in eos])
            for row, mrow in zip(tokens, mask)]


def repeat_rows(batch: Any, g: int) -> Any:
    """Every prompt of a batch repeated `g` times, adjacent (GRPO-style groups of samples)."""
    if g == 1:
        return batch
    rep = lambda xs: tuple(x for x in xs for _ in range(g))  # noqa: E731
    return dataclasses.replace(
        batch,
        input_ids=np.repeat(batch.input_ids, g, axis=0),
        attention_mask=np.repeat(batch.attention_mask, g, axis=0),
        prompt_lens=np.repeat(batch.prompt_lens, g, axis=0),
        prompts=rep(batch.prompts),
        answers=rep(batch.answers),
        meta=rep(batch.meta),
        row_ids=np.repeat(batch.row_ids, g, axis=0),
        global_batch_size=batch.global_batch_size * g,
    )


def trim_responses(batch: dict[str, Any], max_new_tokens: int) -> dict[str, np.ndarray]:
    """The rollout batch (`GENERATED` values, on host) cut to its longest response, rounded up to one of
    `lengths.response_widths`: the columns past it are padding in every row (response mask False), so the
    train and inference calls would compute them only to mask them out. The math is unchanged: attention
    is causal, and every loss, advantage and KL is masked by `response_mask` (length normalisations use
    `max_new_tokens`, not the width)."""
    response_mask = np.asarray(batch["response_mask"])
    n = response_mask.shape[1]
    prompt = np.asarray(batch["tokens"]).shape[1] - n
    width = response_width(int(response_mask.sum(axis=1).max(initial=0)), max_new_tokens)
    out = {}
    for name, x in batch.items():
        x = np.asarray(x)
        if name in SEQUENCE or name == ROUTED:
            x = x[:, :prompt + width]
        elif x.ndim == 2:
            x = x[:, :width]
        out[name] = x
    return out


def select_groups(
    pool: dict[str, Any], scores: np.ndarray, group_size: int, groups: int
) -> tuple[dict[str, Any], dict[str, float]]:
    """DAPO's dynamic sampling: `groups` groups of `group_size` adjacent rows from a larger pool.

    Groups whose `scores` are all equal have advantage 0 under any group baseline: they carry no
    gradient but still dilute a token mean. Informative groups are taken first, in pool order;
    when the pool holds fewer than `groups`, the batch is filled with uninformative ones whose
    `response_mask` is cleared, so they count as no tokens at all (the loss sees only the
    informative groups, as after verl's filter). `pool` maps names to arrays (or dicts of arrays)
    with the pool's rows first; returns the selected rows and counts for logging.
    """
    per_group = np.asarray(scores, np.float32).reshape(-1, group_size)
    informative = ~np.all(per_group == per_group[:, :1], axis=1)
    if len(informative) < groups:
        raise ValueError(f"a pool of {len(informative)} groups cannot fill {groups}")
    order = np.concatenate([np.flatnonzero(informative), np.flatnonzero(~informative)])[:groups]
    rows = (order[:, None] * group_size + np.arange(group_size)).reshape(-1)
    out = jax.tree_util.tree_map(lambda x: np.asarray(x)[rows], pool)
    keep = np.repeat(informative[order], group_size)
    out["response_mask"] = np.asarray(out["response_mask"]) & keep[:, None]
    stats = {"dynamic_sampling/pool_groups": float(len(informative)),
             "dynamic_sampling/informative_groups": float(informative.sum()),
             "dynamic_sampling/kept_groups": float(keep.sum() // group_size)}
    return out, stats


# ---------------------------------------------------------------- the runtime of the family


# RLSettings field -> the `algorithm` key of the sections that have it (PPO's GAE keys, the grpo family's std)
_OWN_KEYS = {"gamma": "gamma", "lam": "lam", "norm_adv_by_std": "norm_adv_by_std", "whiten": "whiten_advantages",
             "value_clip_eps": "value_clip_eps", "normalize_values": "normalize_values"}


class RolloutRuntime:
    """The runtime half of every `jaxrlhf.algorithms.rl.RolloutAlgorithm`: `build_algorithm` joins it to
    the declaration (whose class attributes - estimator, loss, where the KL goes - it reads)."""

    def settings(self) -> RLSettings:
        alg, gen, rw = self.cfg.algorithm, self.cfg.generation, self.cfg.rewards
        actor = getattr(self, "model_configs", {}).get("actor")
        if actor is not None and alg.router_aux_loss_coef and not actor.num_experts:
            raise AlgorithmConfigError(
                f"algorithm.router_aux_loss_coef={alg.router_aux_loss_coef} weighs a mixture of experts' "
                "load-balancing loss, but the actor has no experts (num_experts=0): set it to 0")
        if actor is not None and alg.router_replay and not actor.num_experts:
            raise AlgorithmConfigError(
                "algorithm.router_replay=true replays a mixture of experts' routing, but the actor has no experts "
                "(num_experts=0): set algorithm.router_replay=false")
        # the config holds every default (each algorithm's class in jaxrlhf.config_schema sets its own); a key
        # only some algorithms' classes have is one the others' estimators and losses ignore: RLSettings' value
        own = {setting: getattr(alg, key) for setting, key in _OWN_KEYS.items() if hasattr(alg, key)}
        return RLSettings(
            estimator=self.estimator, loss=self.loss, group_size=alg.group_size, **own,
            clip_eps=alg.clip_eps, clip_eps_high=alg.clip_eps_high, kl_estimator=alg.kl_estimator,
            kl_in_reward=self.kl_in_reward and self.uses_ref, kl_in_loss=not self.kl_in_reward and self.uses_ref,
            loss_agg=alg.loss_agg, max_new_tokens=gen.max_new_tokens,
            minibatches=alg.minibatches, epochs=alg.epochs,
            ratio_early_stop=alg.ratio_early_stop, entropy_coef=alg.entropy_coef, sampling=sampling_params(self.cfg),
            reward_bias=rw.bias, reward_scale=rw.scale, reward_clip=rw.clip, eos_only=rw.eos_only,
            overlong_buffer=alg.overlong_buffer, overlong_penalty=alg.overlong_penalty,
            ignore_eos=gen.ignore_eos, engine=gen.engine, slots=gen.slots, kv_pages=gen.kv_pages,
            correction=Correction.from_config(alg),
            router_aux_coef=alg.router_aux_loss_coef,
            router_top_k=getattr(getattr(self, "model_configs", {}).get("actor"), "num_experts_per_tok", 0),
            router_replay=alg.router_replay,
        )

    # ---- runtime --------------------------------------------------------------------------
    def functions(self) -> dict[str, Any]:
        s = self.settings()
        m = self.models
        tok = self.tokenizer
        micro = self.execution.micro_batch  # each call's rows per micro-batch, as the plan was priced
        eos_ids = () if s.ignore_eos else tok.eos_ids
        gen = functools.partial(generate_call, m["actor"].graphdef, s.sampling, s.max_new_tokens, eos_ids,
                                tok.pad_id, (s.engine, self.group_size, s.slots, s.kv_pages))
        fns: dict[str, Any] = {
            "actor.generate": functools.partial(gen, self.generated_prefix, record_experts=s.router_replay),
            "actor.train": functools.partial(actor_train, m["actor"].graphdef, m["actor"].optimizer,
                                             dataclasses.replace(s, micro_batch=micro("actor.train"))),
        }
        if self.greedy_baseline:
            greedy = functools.partial(generate_call, m["actor"].graphdef, dataclasses.replace(s.sampling, greedy=True),
                                       s.max_new_tokens, eos_ids, tok.pad_id,
                                       (s.engine, self.group_size, s.slots, s.kv_pages))
            fns["actor.generate_greedy"] = functools.partial(greedy, "greedy_")
        if s.correction.active:  # pi_old: the actor's log-probs of the rollout before this step's update
            fns["actor.inference"] = functools.partial(policy_logprobs, m["actor"].graphdef, s.sampling,
                                                       micro("actor.inference"), output="old_logp",
                                                       replay=s.router_replay)
        if "ref" in m:
            fns["ref.inference"] = functools.partial(policy_logprobs, m["ref"].graphdef, s.sampling,
                                                     micro("ref.inference"))
        if "critic" in m:
            fns["critic.inference"] = functools.partial(critic_values, m["critic"].graphdef, micro("critic.inference"))
            fns["critic.train"] = functools.partial(critic_train, m["critic"].graphdef, m["critic"].optimizer,
                                                    dataclasses.replace(s, micro_batch=micro("critic.train")))
        if "reward" in m:
            prefixes = ("", "greedy_") if self.greedy_baseline else ("",)
            fns["reward.inference"] = functools.partial(reward_scores, m["reward"].graphdef, prefixes,
                                                        micro("reward.inference"))
        return fns

    def host_steps(self) -> dict[str, Any]:
        steps: dict[str, Any] = {}
        rules_spec = self.rules_spec
        if rules_spec:
            rules = CombinedReward(rules_spec)
            prefixes = ("", "greedy_") if self.greedy_baseline else ("pool_",) if self.dynamic_sampling else ("",)

            def score_rules(prompts, answers, **responses):
                out = {}
                for p in prefixes:
                    tokens, mask = jax.device_get((responses[f"{p}response_tokens"], responses[f"{p}response_mask"]))
                    texts = decode_responses(self.tokenizer, np.asarray(tokens), np.asarray(mask))
                    pool = self.reward_pool  # worker processes, or here (a rule may score rows concurrently)
                    if pool:
                        parts = pool.score(prompts, texts, answers)
                    else:
                        start = time.perf_counter()
                        parts = rules.batch_components(prompts, texts, answers)
                        self.reward_timing.record(time.perf_counter() - start, len(prompts))
                    out[f"{p}rule_scores"] = np.asarray([rules.combine(c) for c in parts], np.float32)
                    out[f"{p}rule_components"] = {n: np.asarray([c[n] for c in parts], np.float32)
                                                  for n in rules.names}
                return out

            steps["score_rules"] = score_rules
        if self.dynamic_sampling:
            s, groups = self.settings(), self.cfg.data.batch_size

            def select(pool_rule_scores, pool_rule_components, **generated):
                # informative by the task score the advantage sees (EOS gate, clip), without the
                # overlong penalty: DAPO filters on accuracy, and the length ramp alone is no signal
                scores = np.asarray(shape_scores(pool_rule_scores, generated["pool_ended_with_eos"],
                                                 bias=s.reward_bias, scale=s.reward_scale, clip=s.reward_clip,
                                                 eos_only=s.eos_only))
                values = {k.removeprefix("pool_"): v for k, v in generated.items()}
                values.update(rule_scores=pool_rule_scores, rule_components=pool_rule_components)
                out, stats = select_groups(values, scores, self.group_size, groups)
                out = {(self.uncut_prefix + k if k in self.generated else k): v for k, v in out.items()}
                return {**out, "sampling_stats": {k: np.float32(v) for k, v in stats.items()}}

            steps["select_groups"] = select
        if self.trims:
            def trim(**full):
                batch = {k.removeprefix(self.uncut_prefix): v for k, v in full.items()}
                return trim_responses(batch, self.cfg.generation.max_new_tokens)

            steps["trim_responses"] = trim
        alg = self.cfg.algorithm
        if self.packings:
            steps["pack_sequences"] = self._pack_sequences
        if self.uses_ref:
            def kl_control(kl_coef, actor_stats):
                if alg.kl_target is None:
                    return {"kl_coef": kl_coef}
                kl = float(jax.device_get(actor_stats["kl/mean"]))
                return {"kl_coef": adaptive_kl_coef(float(kl_coef), kl, self.batch_rows, alg.kl_target,
                                                    alg.kl_horizon)}

            steps["kl_control"] = kl_control
        return steps

    @property
    def rules_spec(self) -> list[tuple[str, float, dict[str, Any]]]:
        """`rewards.rules` as `CombinedReward` entries."""
        return [(r.name, r.weight, dict(r.args)) for r in self.cfg.rewards.rules]

    @functools.cached_property
    def reward_pool(self) -> Any:
        """The worker processes scoring rule rewards (`rewards.workers`, `rewards.pool`), or None."""
        if not self.cfg.rewards.workers or not self.cfg.rewards.rules:
            return None
        from jaxrlhf.rewards.pool import RewardPool

        return RewardPool(self.rules_spec, self.cfg.rewards.workers, self.reward_timing)

    @functools.cached_property
    def reward_timing(self) -> Any:
        """The rules' seconds per row as this run measures them (`rewards.pool.RewardTiming`), for the
        planner (`reward_fields`)."""
        from jaxrlhf.rewards.pool import RewardTiming, rows_at_once

        return RewardTiming(rows_at_once(self.rules_spec))

    def reward_fields(self) -> dict[str, Any]:
        """The workload's rule-reward fields (`planner.rewards`): the measured seconds per row (0 until
        a batch was scored), rows scored at once, `rewards.workers`."""
        if not self.cfg.rewards.rules:
            return {}
        timing = self.reward_timing
        return {"reward_row_s": timing.row_s, "reward_at_once": timing.at_once,
                "reward_workers": self.cfg.rewards.workers}

    @functools.cached_property
    def episode_timing(self) -> Any:
        """The multi-turn engine's work per episode batch as this run measures it
        (`environments.EpisodeTiming`), for the planner (`episode_fields`)."""
        return EpisodeTiming()

    def episode_fields(self) -> dict[str, Any]:
        """The workload's multi-turn fields (`planner.episodes`) when the rollout's own environments play the
        episodes (`env.name`): the extend width the engine's spec gives and the measured episode work (0
        until a batch ran). Agents' episodes (env.name=openai_agent) are priced as single-turn generation."""
        env = self.cfg.env
        if env.name is None or env.name == AGENT_ENVIRONMENT:
            return {}
        return {"multi_turn": True, "env_extend_width": 1 + env.max_observation_tokens,
                **self.episode_timing.fields()}

    def _pack_sequences(self, tokens, mask, positions, response_mask, shards, rng_actor, rng_critic=None,
                        router_experts=None):
        """The host step `pack_sequences`: the batch packed for each call that reads it (`models.packing`):
        the inference calls' packing over the whole batch, each train call's over the minibatches its key
        draws (`update.minibatch_indices`, as the unpacked call draws them in its program); with router
        replay the recorded experts packed beside the tokens of the packings an actor call reads."""
        alg = self.cfg.algorithm
        mask = np.asarray(mask)
        rows, width = mask.shape[0], np.asarray(response_mask).shape[1]
        keys = {"packed_actor": rng_actor, "packed_critic": rng_critic}
        out: dict[str, Any] = {}
        stats: dict[str, np.float32] = {}
        for name, readers in self.packings.items():
            if name in keys:
                updates = np.asarray(minibatch_indices(keys[name], rows, alg.minibatches, alg.epochs))
            else:
                updates = np.arange(rows)[None]
            replayed = router_experts is not None and any(c.startswith("actor.") for c in readers)
            out[name], packed = pack_batch(mask, tokens, positions, width, updates,
                                           shards=math.lcm(*(shards[c] for c in readers)),
                                           budget=self.execution.token_budget,
                                           experts=np.asarray(router_experts) if replayed else None)
            short = name.removeprefix("packed_")
            stats.update({k: np.float32(v) for k, v in packed.metrics(f"packing/{short}").items()})
            stats[f"packing/{short}/micro_batches"] = np.float32(out[name]["slots"].shape[2])
        out["packing_stats"] = stats
        return out

    def initial_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"kl_coef": np.float32(self.cfg.algorithm.kl_coef)}
        if self.uses_critic:
            state["value_moments"] = jax.tree_util.tree_map(np.asarray, RunningMoments.create())
        return state

    def dataset(self, tokenizer: Any, split: str | None = None) -> Any:
        from jaxrlhf.data import PromptDataset

        return PromptDataset.from_config(self.cfg, tokenizer, split=split,
                                         batch_size=self.cfg.data.batch_size * self.pool_factor)

    def episode_values(self, params: nnx.State, feed: dict[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """`env.name`: the feed's prompts played as environment episodes by the actor (`params`, on the generate
        call's placement) through the multi-turn engine (`models.multiturn`): the generate call's outputs
        (named as the graph's, with `action_mask` and `env_reward`) and the `env/...` metrics. Each row's
        prompt is its environment's first observation (`reset`), tokenized; responses are padded to
        generation.max_new_tokens, as the generate call's."""
        from jaxrlhf.environments import EnvironmentContext, make_environment
        from jaxrlhf.models import multiturn
        from jaxrlhf.models.lengths import bucket_length
        from jaxrlhf.environments.tool_calls import detect_tool_format

        cfg, tok, s = self.cfg, self.tokenizer, self.settings()
        env = cfg.env
        template = getattr(tok, "chat_template", None)
        raw = getattr(tok, "_tok", None)  # HFTokenizer's `tokenizers.Tokenizer`: special tokens as text
        end_of_turn = tuple(raw.id_to_token(i) for i in tok.eos_ids) if raw is not None else ()
        context = EnvironmentContext(tokenizer=tok, chat_template=template, end_of_turn=end_of_turn,
                                     tool_format=detect_tool_format(template.tool_source) if template else None)
        rows = [{"prompt": p, "answer": a} for p, a in zip(feed["prompts"], feed["answers"])]
        if env.workers:  # each episode's environment in a worker process (`environments.pool`), reset there
            pool = self._env_pool(context)
            envs, first = pool.reset(rows)
        else:
            envs = [make_environment(env.name, context, env.args) for _ in rows]
            first = [e.reset(row) for e, row in zip(envs, rows)]
        prefix = [] if template is not None else list(tok.special_prefix)  # a rendered template holds its BOS
        prompt_ids = [prefix + tok.encode(observation.text) for observation in first]
        budget = env.max_tokens or s.max_new_tokens
        longest = max(len(p) for p in prompt_ids)
        actor = getattr(self, "model_configs", {}).get("actor")
        positions = actor.max_position_embeddings if actor is not None else longest + budget + 16
        room = (positions - budget) // 16 * 16  # prompt columns left beside the trajectory, in pages of 16
        if longest > room:
            raise ValueError(
                f"env.name={env.name}: a first observation (the environment's prompt, e.g. with its tools described) "
                f"of {longest} tokens and a trajectory of env.max_tokens={budget} exceed the actor's "
                f"{positions} positions: shorten the prompts (data.max_prompt_len) or env.max_tokens")
        spec = multiturn.MultiTurnSpec(
            rows=len(rows), prompt_bucket=bucket_length(longest, cap=room), max_tokens=budget,
            max_turn_tokens=env.max_turn_tokens or budget, sampling=s.sampling, eos_ids=tuple(tok.eos_ids),
            pad_id=tok.pad_id, max_observation_tokens=env.max_observation_tokens)
        graphdef = self.models["actor"].graphdef
        try:  # with workers, a thread per worker waits on its pipe
            out = multiturn.generate_multiturn(graphdef, params, envs=envs, rows=rows, encode=tok.encode,
                                               decode_text=tok.decode, rng=feed["rng_generate"], spec=spec,
                                               max_turns=env.max_turns, threads=max(env.threads, env.workers),
                                               prompt_ids=prompt_ids, failure_reward=env.failure)
        finally:
            if env.workers:
                pool.release(envs)
        self.episode_timing.record(out.decode_steps, out.extends, out.env_wait_s)
        values = out.rollout_batch()
        pad = s.max_new_tokens - budget  # the batch's response width is the generate call's
        for name in ("response_tokens", "response_mask", "behaviour_logp", ACTION_MASK, "tokens", "mask"):
            fill = tok.pad_id if name.endswith("tokens") else 0
            values[name] = np.pad(values[name], ((0, 0), (0, pad)), constant_values=fill)
        values["positions"] = np.maximum(np.cumsum(values["mask"], axis=1) - 1, 0).astype(np.int32)
        return {self.generated_prefix + k: v for k, v in values.items()}, out.metrics()

    def _env_pool(self, context: Any) -> Any:
        """The worker processes holding the episodes' environments (`env.workers`), started at the first
        step and kept for the run (stopped with it)."""
        pool = getattr(self, "_environment_pool", None)
        if pool is None:
            import weakref

            from jaxrlhf.environments.pool import EnvPool

            env = self.cfg.env
            pool = EnvPool(env.name, context, env.args, workers=env.workers, step_timeout_s=env.step_timeout_s,
                           imports=env.imports)
            self._environment_pool = pool
            weakref.finalize(self, pool.close)
        return pool

    def feed(self, batch: Any, rng: jax.Array) -> dict[str, Any]:
        batch = repeat_rows(batch, self.group_size)
        gen, actor, critic = jax.random.split(rng, 3)
        feed = {
            "prompt_tokens": batch.input_ids, "prompt_mask": batch.attention_mask, "prompts": batch.prompts,
            "answers": batch.answers, "rng_generate": gen, "rng_actor": actor,
        }
        if self.uses_critic:
            feed["rng_critic"] = critic
        if self.cfg.generation.simulated_lengths:
            feed["max_lengths"] = simulated_lengths(self.cfg, gen, len(batch.prompts))
        return feed

    def metric_values(self) -> tuple[str, ...]:
        return ("actor_stats", "critic_stats", "response_mask", "ended_with_eos", "mask", "rule_scores",
                "rule_components", "model_scores", "greedy_rule_scores", "sampling_stats", "packing_stats")

    def metrics(self, result: Any) -> dict[str, float]:
        v = result.values
        stats = dict(v["actor_stats"])
        if "critic_stats" in v:
            stats.update(v["critic_stats"])
        stats, rmask, ended, mask = jax.device_get((stats, v["response_mask"], v["ended_with_eos"], v["mask"]))
        out = {k: float(x) for k, x in stats.items()}
        out.update({
            "response/length_mean": float(np.sum(rmask, axis=1).mean()),
            "response/eos_frac": float(np.mean(ended)),
            "throughput/tokens_per_s": float(np.sum(mask)) / max(result.seconds, 1e-9),
        })
        if "rule_scores" in v:
            out["reward/rule_mean"] = float(np.mean(v["rule_scores"]))
            out.update({f"reward/rule/{n}": float(np.mean(x)) for n, x in v["rule_components"].items()})
        if "model_scores" in v:
            out["reward/model_mean"] = float(np.mean(jax.device_get(v["model_scores"])))
        if "greedy_rule_scores" in v:
            out["reward/greedy_rule_mean"] = float(np.mean(v["greedy_rule_scores"]))
        for stats_of in ("sampling_stats", "packing_stats"):
            if stats_of in v:
                out.update({k: float(x) for k, x in v[stats_of].items()})
        return out

    def evaluate(self, executor: Any) -> dict[str, float]:
        """Held-out metrics on `data.eval_split` (docs/evaluation.md): the mean of every rule reward
        (unweighted) and the accuracy of greedy responses; with `eval.samples`, pass@k over that many
        sampled responses per prompt (the rollout's sampling settings), Chen et al.'s estimator."""
        if not self.cfg.rewards.rules or not self.cfg.data.eval_split:
            return {}
        ev = self.cfg.eval
        rules = CombinedReward([(r.name, r.weight, dict(r.args)) for r in self.cfg.rewards.rules])
        judge = ev.correct_rule or self.cfg.rewards.rules[0].name

        def scored(batch: Any, out: dict[str, Any]) -> list[dict[str, float]]:
            tokens, mask = jax.device_get((out["response_tokens"], out["response_mask"]))
            texts = decode_responses(self.tokenizer, np.asarray(tokens), np.asarray(mask))
            return rules.batch_components(batch.prompts, texts, batch.answers)

        totals: dict[str, float] = {}
        count = 0.0
        for batch, weight in self._eval_batches(self.batch_rows):
            out = executor.run_at("actor.generate", self._greedy_generate, {
                "prompt_tokens": batch.input_ids, "prompt_mask": batch.attention_mask,
                "rng_generate": jax.random.key(0)})
            for parts, w in zip(scored(batch, out), weight):
                for name, value in parts.items():
                    totals[name] = totals.get(name, 0.0) + w * value
                totals["accuracy"] = totals.get("accuracy", 0.0) + w * (parts[judge] >= ev.correct_threshold)
            count += float(np.sum(weight))
        metrics = {f"eval/greedy/{name}": float(total) / max(count, 1.0) for name, total in totals.items()}
        metrics["eval/prompts"] = count
        if not ev.samples:
            return metrics
        n, passed, prompts = ev.samples, dict.fromkeys(ev.pass_k, 0.0), 0.0
        key = jax.random.key(self.cfg.run.seed)
        for i, (batch, weight) in enumerate(self._eval_batches(self.batch_rows // n)):
            group = repeat_rows(batch, n)
            out = executor.run_at("actor.generate", self._sampled_generate, {
                "prompt_tokens": group.input_ids, "prompt_mask": group.attention_mask,
                "rng_generate": jax.random.fold_in(key, i)})
            correct = np.asarray([p[judge] >= ev.correct_threshold for p in scored(group, out)]).reshape(-1, n)
            for c, w in zip(correct.sum(axis=1), weight):
                for k in passed:
                    passed[k] += w * pass_at_k(n, int(c), k)
            prompts += float(np.sum(weight))
        metrics.update({f"eval/pass_at_{k}": float(v) / max(prompts, 1.0) for k, v in passed.items()})
        metrics["eval/samples_per_prompt"] = float(n)
        return metrics

    def _eval_batches(self, size: int) -> Any:
        """Held-out batches of `size` prompts with real-row weights, up to `eval.max_prompts` prompts."""
        data = self.dataset(self.tokenizer, split=self.cfg.data.eval_split)
        left = self.cfg.eval.max_prompts
        for batch, weight in data.single_pass(size):
            if left is not None:
                weight = np.where(np.cumsum(weight) <= left, weight, 0.0).astype(np.float32)
                left -= int(np.sum(weight))
            yield batch, weight
            if left is not None and left <= 0:
                return

    @functools.cached_property
    def _greedy_generate(self) -> Any:
        """Greedy decoding for evaluation, bound once (the call cache keys compiled functions by identity)."""
        s = self.settings()
        return functools.partial(
            generate_call, self.models["actor"].graphdef, dataclasses.replace(s.sampling, greedy=True),
            s.max_new_tokens, self.tokenizer.eos_ids, self.tokenizer.pad_id, (s.engine, 1, s.slots, s.kv_pages), "")

    @functools.cached_property
    def _sampled_generate(self) -> Any:
        """Sampling with the rollout's settings for pass@k, bound once."""
        s = self.settings()
        return functools.partial(generate_call, self.models["actor"].graphdef, s.sampling, s.max_new_tokens,
                                 self.tokenizer.eos_ids, self.tokenizer.pad_id,
                                 (s.engine, self.cfg.eval.samples, s.slots, s.kv_pages), "")


def simulated_lengths(cfg: Any, rng: jax.Array, rows: int) -> np.ndarray:
    """Each response's length under `generation.simulated_lengths`: log-normal around
    `plan.response_length_median` with `plan.response_length_sigma`, capped at `generation.max_new_tokens`
    (`lengths.lognormal_lengths`, the planner's distribution), drawn from the step's generation key."""
    seed = np.asarray(jax.random.key_data(rng)).astype(np.uint32).ravel()
    z = np.random.default_rng(seed).standard_normal(rows)
    return lognormal_lengths(z, cfg.plan.response_length_median, cfg.plan.response_length_sigma,
                             cfg.generation.max_new_tokens).astype(np.int32)


def sampling_params(cfg: Any) -> SamplingParams:
    gen = cfg.generation
    return SamplingParams(temperature=gen.temperature, top_k=gen.top_k, top_p=gen.top_p, greedy=gen.greedy)

