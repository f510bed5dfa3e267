"""What each model call of the PPO graph computes, as pure functions.

These know nothing about placement: the engine jits them per placement
(`jaxrlhf.mesh.calls.CallCache`). The model structure (`graphdef`), the
optimizer and the hyper-parameters are bound with `functools.partial` and are
static; parameters, optimizer state and the experience batch are arguments.

Conventions for a batch of sequences [B, L] = left-padded prompt (P tokens)
followed by the response (N tokens, right-padded): the logits at position
P-1+t predict response token t, and the critic's value at the same position
is V(s_t), the value of the state *before* response token t.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jaxtyping import Array, Bool, Float, Int

from jaxrlhf.models.sampling import SamplingParams, entropy, response_logprobs, token_logprobs
from jaxrlhf.ppo.advantages import AdvantageBatch, compute_advantages
from jaxrlhf.ppo.kl import kl_per_token, token_level_rewards
from jaxrlhf.ppo.losses import get_loss, importance_ratio_exploded, value_loss
from jaxrlhf.ppo.optim import guarded_update
from jaxrlhf.ppo.stats import RunningMoments, masked_mean, masked_whiten


@struct.dataclass
class Experience:
    """Everything the train calls need about one batch of rollouts (a pytree)."""

    tokens: Int[Array, "batch total"]
    mask: Bool[Array, "batch total"]
    positions: Int[Array, "batch total"]
    response_tokens: Int[Array, "batch new"]
    response_mask: Bool[Array, "batch new"]
    behaviour_logp: Float[Array, "batch new"]  # log-probs the sampler used
    ref_logp: Float[Array, "batch new"]
    values: Float[Array, "batch new"]  # critic output, critic units (normalised if enabled)
    bootstrap_values: Float[Array, "batch"]  # V after the last response token, critic units
    scores: Float[Array, "batch"]  # shaped sequence scores
    ended_with_eos: Bool[Array, "batch"]

    @property
    def prompt_length(self) -> int:
        return self.tokens.shape[1] - self.response_tokens.shape[1]


@dataclasses.dataclass(frozen=True)
class PPOHParams:
    """Static hyper-parameters of the train calls (hashable: part of the compile key)."""

    loss: str = "ppo"
    advantage: str = "gae"
    gamma: float = 1.0
    lam: float = 1.0
    group_size: int = 1
    clip_eps: float = 0.2
    value_clip_eps: float | None = 0.2
    kl_estimator: str = "k1"
    kl_in_reward: bool = True  # PPO: -beta*KL per token in the reward; GRPO: KL term in the loss
    minibatches: int = 4
    epochs: int = 1
    ratio_early_stop: float | None = 5.0
    whiten_advantages: bool = True
    normalize_values: bool = False
    entropy_coef: float = 0.0
    sampling: SamplingParams = SamplingParams()


def _response_slice(x: jax.Array, prompt_len: int) -> jax.Array:
    """Outputs at positions P-1 .. L-2: the ones that predict (or value) response tokens."""
    return x[:, prompt_len - 1 : -1]


# ---------------------------------------------------------------- inference calls


def policy_logprobs(
    graphdef: nnx.GraphDef,
    sampling: SamplingParams,
    state: nnx.State,
    tokens: Int[Array, "batch total"],
    mask: Bool[Array, "batch total"],
    positions: Int[Array, "batch total"],
    response_tokens: Int[Array, "batch new"],
    response_mask: Bool[Array, "batch new"],
) -> Float[Array, "batch new"]:
    """Log-probs of the response under a policy (reference model), same logits processing as sampling."""
    logits, _ = nnx.merge(graphdef, state)(tokens, positions, mask)
    return response_logprobs(logits, response_tokens, response_mask, sampling)


def critic_values(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    tokens: Int[Array, "batch total"],
    mask: Bool[Array, "batch total"],
    positions: Int[Array, "batch total"],
    response_mask: Bool[Array, "batch new"],
) -> tuple[Float[Array, "batch new"], Float[Array, "batch"]]:
    """V(s_t) for every response token, and V after the last response token (for bootstrapping)."""
    v = nnx.merge(graphdef, state)(tokens, positions, mask)
    n = response_mask.shape[1]
    p = tokens.shape[1] - n
    values = jnp.where(response_mask, _response_slice(v, p), 0.0)
    last = p - 1 + jnp.sum(response_mask, axis=1).astype(jnp.int32)
    bootstrap = jnp.take_along_axis(v, last[:, None], axis=1)[:, 0]
    return values, bootstrap


def reward_scores(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    tokens: Int[Array, "batch total"],
    mask: Bool[Array, "batch total"],
    positions: Int[Array, "batch total"],
) -> Float[Array, "batch"]:
    """Reward-model score of each sequence (read at its last real token)."""
    return nnx.merge(graphdef, state)(tokens, positions, mask)


# ---------------------------------------------------------------- advantages


def advantages_and_returns(
    exp: Experience, hp: PPOHParams, kl_coef: Float[Array, ""], moments: RunningMoments
) -> tuple[Float[Array, "batch new"], Float[Array, "batch new"], Float[Array, "batch new"]]:
    """(advantages, returns in reward units, per-token KL): identical wherever it runs.

    Both train calls compute it from the same experience, so no extra
    transfer between their device groups is needed.
    """
    mask = exp.response_mask.astype(jnp.float32)
    kl = kl_per_token(exp.behaviour_logp, exp.ref_logp, mask, kind=hp.kl_estimator)
    rewards = token_level_rewards(exp.scores, mask, kl if hp.kl_in_reward else None, kl_coef)
    if hp.normalize_values:
        values, bootstrap = moments.denormalize(exp.values), moments.denormalize(exp.bootstrap_values)
    else:
        values, bootstrap = exp.values, exp.bootstrap_values
    kwargs: dict[str, Any] = {}
    if hp.advantage == "gae":
        kwargs = {"gamma": hp.gamma, "lam": hp.lam}
        batch = AdvantageBatch(rewards, mask, values * mask, bootstrap, exp.ended_with_eos)
    else:
        if hp.advantage in ("grpo", "rloo"):
            kwargs = {"group_size": hp.group_size}
        batch = AdvantageBatch(rewards, mask)
    adv, returns = compute_advantages(hp.advantage, batch, **kwargs)
    if hp.whiten_advantages:
        adv = masked_whiten(adv, mask)
    return adv, returns, kl


def _minibatch_indices(rng: jax.Array, batch: int, hp: PPOHParams) -> Int[Array, "updates size"]:
    """Row indices of every minibatch of every epoch: [epochs * minibatches, batch / minibatches]."""
    size = batch // hp.minibatches
    perms = [jax.random.permutation(k, batch) for k in jax.random.split(rng, hp.epochs)]
    return jnp.concatenate(perms).reshape(hp.epochs * hp.minibatches, size)


def _take(tree: Any, idx: jax.Array) -> Any:
    return jax.tree_util.tree_map(lambda x: jnp.take(x, idx, axis=0), tree)


def _update_loop(loss_fn, optimizer, state, opt_state, data, rng, hp: PPOHParams, batch: int, check_ratio: bool):
    """PPO epochs x minibatches as one `lax.scan`: one optimizer update per minibatch.

    An update is skipped when its loss or gradients are non-finite; with
    `check_ratio` every later update of the step is skipped once an importance
    ratio exceeded `hp.ratio_early_stop` (counted in the stats).
    """
    idx = _minibatch_indices(rng, batch, hp)

    def one(carry, rows):
        state, opt_state, stopped = carry
        mb = _take(data, rows)
        (loss, (stats, exploded)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state, mb)
        if check_ratio and hp.ratio_early_stop is not None:
            stopped = stopped | exploded
        state, opt_state, finite = guarded_update(optimizer, grads, opt_state, state, loss, ~stopped)
        stats = dict(stats)
        stats["grad_norm"] = optax.global_norm(grads)
        stats["skipped_nonfinite"] = (~finite).astype(jnp.float32)
        stats["skipped_ratio"] = stopped.astype(jnp.float32)
        return (state, opt_state, stopped), stats

    (state, opt_state, _), stats = jax.lax.scan(one, (state, opt_state, jnp.array(False)), idx)
    summed = {"skipped_nonfinite", "skipped_ratio"}
    stats = {k: (jnp.sum(v) if k in summed else jnp.mean(v)) for k, v in stats.items()}
    return state, opt_state, stats


# ---------------------------------------------------------------- train calls


def actor_train(
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    hp: PPOHParams,
    state: nnx.State,
    opt_state: Any,
    exp: Experience,
    kl_coef: Float[Array, ""],
    moments: RunningMoments,
    rng: jax.Array,
) -> tuple[nnx.State, Any, dict[str, jax.Array]]:
    """PPO policy update over the experience; returns new params, optimizer state and stats."""
    adv, _, kl = advantages_and_returns(exp, hp, kl_coef, moments)
    loss_impl = get_loss(hp.loss)
    p = exp.prompt_length
    loss_kwargs: dict[str, Any] = {"clip_eps": hp.clip_eps, "entropy_coef": hp.entropy_coef}
    if hp.loss == "grpo" and not hp.kl_in_reward:
        loss_kwargs.update(kl_coef=kl_coef)

    def loss_fn(state, mb):
        logits, _ = nnx.merge(graphdef, state)(mb["tokens"], mb["positions"], mb["mask"])
        logits = _response_slice(logits, p)
        logp = token_logprobs(logits, mb["response_tokens"], hp.sampling)
        logp = jnp.where(mb["response_mask"], logp, 0.0)
        ent = entropy(logits, hp.sampling)
        loss, stats = loss_impl(
            logp, mb["old_logp"], mb["adv"], mb["response_mask"], ref_logp=mb["ref_logp"], entropy=ent,
            **loss_kwargs,
        )
        if "entropy" not in stats:
            stats["entropy"] = masked_mean(jax.lax.stop_gradient(ent), mb["response_mask"])
        exploded = (
            importance_ratio_exploded(logp, mb["old_logp"], mb["response_mask"], hp.ratio_early_stop)
            if hp.ratio_early_stop is not None
            else jnp.array(False)
        )
        return loss, (stats, jax.lax.stop_gradient(exploded))

    data = {
        "tokens": exp.tokens, "mask": exp.mask, "positions": exp.positions,
        "response_tokens": exp.response_tokens, "response_mask": exp.response_mask,
        "old_logp": exp.behaviour_logp, "ref_logp": exp.ref_logp, "adv": adv,
    }
    state, opt_state, stats = _update_loop(
        loss_fn, optimizer, state, opt_state, data, rng, hp, exp.tokens.shape[0], check_ratio=True
    )
    mask = exp.response_mask.astype(jnp.float32)
    stats["kl/mean"] = jnp.mean(jnp.sum(kl * mask, axis=1))  # per-sequence KL, averaged
    stats["kl/token_mean"] = masked_mean(kl, mask)
    stats["advantages/mean"] = masked_mean(adv, mask)
    return state, opt_state, stats


def critic_train(
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    hp: PPOHParams,
    state: nnx.State,
    opt_state: Any,
    exp: Experience,
    kl_coef: Float[Array, ""],
    moments: RunningMoments,
    rng: jax.Array,
) -> tuple[nnx.State, Any, RunningMoments, dict[str, jax.Array]]:
    """Clipped value regression onto the GAE returns; updates the value-normalisation moments."""
    _, returns, _ = advantages_and_returns(exp, hp, kl_coef, moments)
    mask = exp.response_mask.astype(jnp.float32)
    if hp.normalize_values:
        moments = moments.update(returns, mask)
        returns = moments.normalize(returns)
    p = exp.prompt_length

    def loss_fn(state, mb):
        v = nnx.merge(graphdef, state)(mb["tokens"], mb["positions"], mb["mask"])
        values = _response_slice(v, p)
        loss, stats = value_loss(
            values, mb["old_values"], mb["returns"], mb["response_mask"], clip_eps=hp.value_clip_eps
        )
        return loss, (stats, jnp.array(False))

    data = {
        "tokens": exp.tokens, "mask": exp.mask, "positions": exp.positions,
        "response_mask": exp.response_mask, "old_values": exp.values, "returns": returns,
    }
    state, opt_state, stats = _update_loop(
        loss_fn, optimizer, state, opt_state, data, rng, hp, exp.tokens.shape[0], check_ratio=False
    )
    stats = {f"critic/{k}" if not k.startswith(("loss/", "value/")) else k: v for k, v in stats.items()}
    stats["returns/mean"] = masked_mean(returns, mask)
    return state, opt_state, moments, stats


def sft_train(
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    state: nnx.State,
    opt_state: Any,
    tokens: Int[Array, "batch length"],
    mask: Bool[Array, "batch length"],
    loss_mask: Bool[Array, "batch length"],
) -> tuple[nnx.State, Any, Float[Array, ""]]:
    """One supervised next-token step on demonstrations (the loss covers completion tokens only)."""
    from jaxrlhf.models.transformer import positions_from_mask

    positions = positions_from_mask(mask)

    def loss_fn(state):
        logits, _ = nnx.merge(graphdef, state)(tokens, positions, mask)
        logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
        nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
        return masked_mean(nll, loss_mask[:, 1:])

    loss, grads = jax.value_and_grad(loss_fn)(state)
    state, opt_state, _ = guarded_update(optimizer, grads, opt_state, state, loss)
    return state, opt_state, loss
