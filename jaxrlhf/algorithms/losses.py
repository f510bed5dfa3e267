"""Policy losses (selected by name from a registry), the clipped value loss, and the early-stop check.

Every policy loss has the same signature

    fn(logp, old_logp, advantages, mask, *, ref_logp=None, entropy=None, **hparams)
        -> (loss scalar, stats dict of scalars)

and is registered with `@register_loss("name")`. `logp` are the log-probs of
the sampled tokens under the current parameters (recomputed with the same
logits processing as sampling), `old_logp` those of the policy the ratio is
taken against: the rollout's behaviour log-probs, or with a rollout correction
the trainer's recomputed ones (`jaxrlhf.algorithms.correction`), whose
`token_weights` keyword then scales each token's surrogate.

Aggregation over tokens (`agg`):
- "token-mean" (default for PPO): mean over every response token of the
  batch; long sequences weigh more. Matches ReaLHF/TRL PPO.
- "seq-mean-token-mean" (default for GRPO, as in the paper): mean over each
  sequence's tokens, then over sequences; every sequence weighs the same.
- "seq-mean-token-sum-norm" (Dr. GRPO): each sequence's token *sum* divided by
  a constant (`norm_len`, the maximum response length), then the mean over
  sequences: no length bias in either direction.
"gspo" works on one ratio per sequence and always averages per sequence.
Under jit on a sharded batch both are global means (see `stats`). With
gradient accumulation over micro-batches, token-mean must be divided by the
token count of the whole minibatch, not of each micro-batch.

Stats are wrapped in `stop_gradient`; they are for logging only.
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from jaxrlhf.algorithms.kl import kl_per_token
from jaxrlhf.algorithms.stats import masked_max, masked_mean, masked_sum
from jaxrlhf.registry import Registry

TokenArray = Float[Array, "batch time"]
Mask = Float[Array, "batch time"] | Bool[Array, "batch time"]
Stats = dict[str, Float[Array, ""]]

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def aggregate(
    loss_per_token: TokenArray, mask: Mask, agg: str = "token-mean", norm_len: int | None = None,
    rows: Float[Array, ""] | None = None,
) -> Float[Array, ""]:
    """Reduce a per-token loss to a scalar over the masked-in tokens (see module docstring). `rows`: the
    rows the constant normaliser counts (a packed micro-batch's filled slots; None: every row)."""
    if agg == "token-mean":
        return masked_mean(loss_per_token, mask)
    if agg == "seq-mean-token-mean":
        has_tokens = (jnp.sum(jnp.asarray(mask).astype(jnp.float32), axis=-1) > 0).astype(jnp.float32)
        return jnp.sum(masked_mean(loss_per_token, mask, axis=-1)) / jnp.maximum(jnp.sum(has_tokens), 1.0)
    if agg == "seq-mean-token-sum-norm":  # sum / (rows * L_max), as the Dr. GRPO code and TRL's dr_grpo
        length = norm_len if norm_len is not None else loss_per_token.shape[-1]
        count = loss_per_token.shape[0] if rows is None else rows
        return jnp.sum(masked_sum(loss_per_token, mask, axis=-1)) / (count * length)
    raise ValueError(f"unknown loss aggregation {agg!r}; choose one of {AGGREGATIONS}")


def aggregation_weight(mask: Mask, agg: str = "token-mean", rows: Float[Array, ""] | None = None) -> Float[Array, ""]:
    """The share of a micro-batch in `aggregate`'s normaliser: tokens for a token mean, sequences
    with tokens for a sequence mean, rows (`rows` when given) for the Dr. GRPO constant normaliser."""
    m = jnp.asarray(mask).astype(jnp.float32)
    if agg == "token-mean":
        return jnp.sum(m)
    if agg == "seq-mean-token-mean":
        return jnp.sum((jnp.sum(m, axis=-1) > 0).astype(jnp.float32))
    if agg == "seq-mean-token-sum-norm":
        return jnp.asarray(m.shape[0] if rows is None else rows, jnp.float32)
    raise ValueError(f"unknown loss aggregation {agg!r}; choose one of {AGGREGATIONS}")


class PolicyLossFn(Protocol):
    def __call__(
        self,
        logp: TokenArray,
        old_logp: TokenArray,
        advantages: TokenArray,
        mask: Mask,
        *,
        ref_logp: TokenArray | None = None,
        entropy: TokenArray | None = None,
        **hparams,
    ) -> tuple[Float[Array, ""], Stats]: ...


POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")
register_loss = POLICY_LOSSES.register


def get_loss(name: str) -> PolicyLossFn:
    """The policy loss registered as `name`; a clear error naming the known ones otherwise."""
    return POLICY_LOSSES.get(name)


def _clipped_surrogate(
    logp: TokenArray,
    old_logp: TokenArray,
    advantages: TokenArray,
    mask: Mask,
    clip_eps: float,
    clip_eps_high: float | None,
    dual_clip: float | None,
) -> tuple[TokenArray, Stats]:
    """Per-token clipped surrogate loss -min(r A, clip(r) A) (optionally dual-clipped) and its stats."""
    high = clip_eps if clip_eps_high is None else clip_eps_high
    log_ratio = (logp - old_logp).astype(jnp.float32)
    ratio = jnp.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - clip_eps, 1.0 + high)
    loss = jnp.maximum(unclipped, clipped)
    stats: Stats = {
        "clipfrac": masked_mean((clipped > unclipped).astype(jnp.float32), mask),
        # k3 estimate of KL(old || new) from the sampled tokens: >= 0 and low variance.
        "approx_kl": masked_mean(ratio - 1.0 - log_ratio, mask),
        "ratio/mean": masked_mean(ratio, mask),
        "ratio/max": masked_max(ratio, mask),
    }
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1 (Ye et al. use 3), got {dual_clip}")
        # For negative advantages a huge ratio makes the clipped loss unbounded;
        # cap it at -A * c so one stale token cannot dominate the update.
        capped = -advantages * dual_clip
        dual_active = (advantages < 0) & (loss > capped)
        loss = jnp.where(advantages < 0, jnp.minimum(loss, capped), loss)
        stats["dual_clipfrac"] = masked_mean(dual_active.astype(jnp.float32), mask)
    return loss, stats


def _entropy_term(
    entropy: TokenArray | None, mask: Mask, agg: str, coef: float, stats: Stats, norm_len: int | None = None,
    rows: Float[Array, ""] | None = None,
) -> Float[Array, ""]:
    if entropy is None:
        if coef:
            raise ValueError("entropy_coef is set but no entropy was given")
        return jnp.zeros((), jnp.float32)
    mean_entropy = aggregate(entropy, mask, agg, norm_len, rows)
    stats["entropy"] = masked_mean(entropy, mask)
    return -coef * mean_entropy


@register_loss("ppo")
def ppo_policy_loss(
    logp: TokenArray,
    old_logp: TokenArray,
    advantages: TokenArray,
    mask: Mask,
    *,
    ref_logp: TokenArray | None = None,
    entropy: TokenArray | None = None,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
    entropy_coef: float = 0.0,
    agg: str = "token-mean",
    norm_len: int | None = None,
    token_weights: TokenArray | None = None,
    rows: Float[Array, ""] | None = None,
) -> tuple[Float[Array, ""], Stats]:
    """Clipped PPO surrogate (Schulman et al. 2017), eps 0.2.

    Clipping the importance ratio to [1 - eps, 1 + eps_high] removes the
    incentive to move the policy far from the rollout policy within one
    batch. `dual_clip` (e.g. 3) bounds the loss for negative advantages
    (Ye et al. 2020). `ref_logp` is ignored: PPO puts the KL into the reward.
    `token_weights` (a rollout correction's, constants) multiply each token's surrogate.
    """
    del ref_logp
    loss_tok, stats = _clipped_surrogate(logp, old_logp, advantages, mask, clip_eps, clip_eps_high, dual_clip)
    if token_weights is not None:
        loss_tok = loss_tok * token_weights
    loss = aggregate(loss_tok, mask, agg, norm_len, rows)
    loss = loss + _entropy_term(entropy, mask, agg, entropy_coef, stats, norm_len, rows)
    stats["loss/policy"] = loss
    return loss, jax.lax.stop_gradient(stats)


@register_loss("grpo")
def grpo_policy_loss(
    logp: TokenArray,
    old_logp: TokenArray,
    advantages: TokenArray,
    mask: Mask,
    *,
    ref_logp: TokenArray | None = None,
    entropy: TokenArray | None = None,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    kl_coef: float = 0.0,
    kl_kind: str = "k3",
    entropy_coef: float = 0.0,
    agg: str = "seq-mean-token-mean",
    norm_len: int | None = None,
    token_weights: TokenArray | None = None,
    rows: Float[Array, ""] | None = None,
) -> tuple[Float[Array, ""], Stats]:
    """GRPO loss (Shao et al. 2024): the clipped surrogate plus an optional KL-to-reference term.

    GRPO has no per-token KL reward; with `kl_coef > 0` it adds
    `kl_coef * k3(logp, ref_logp)` to every token's loss instead (the paper
    uses 0.04), which needs `ref_logp`. Sequences are averaged per sequence
    first by default, as in the paper. `token_weights` (a rollout correction's, constants) multiply
    each token's surrogate, not its KL term.
    """
    loss_tok, stats = _clipped_surrogate(logp, old_logp, advantages, mask, clip_eps, clip_eps_high, None)
    if token_weights is not None:
        loss_tok = loss_tok * token_weights
    kl = _kl_loss_term(logp, ref_logp, mask, kl_coef, kl_kind, stats, "grpo")
    if kl is not None:
        loss_tok = loss_tok + kl
    loss = aggregate(loss_tok, mask, agg, norm_len, rows)
    loss = loss + _entropy_term(entropy, mask, agg, entropy_coef, stats, norm_len, rows)
    stats["loss/policy"] = loss
    return loss, jax.lax.stop_gradient(stats)


def _kl_loss_term(
    logp: TokenArray, ref_logp: TokenArray | None, mask: Mask, kl_coef: float, kl_kind: str, stats: Stats, who: str
) -> TokenArray | None:
    """coef * KL(pi || ref) per token, or None when the coefficient is a literal 0."""
    if isinstance(kl_coef, (int, float)) and kl_coef == 0:  # a traced coefficient always counts
        return None
    if ref_logp is None:
        raise ValueError(f"{who} loss with kl_coef > 0 needs ref_logp")
    kl = kl_per_token(logp, ref_logp, mask, kind=kl_kind)
    stats["kl/loss"] = masked_mean(kl, mask)
    return kl_coef * kl


@register_loss("gspo")
def gspo_policy_loss(
    logp: TokenArray,
    old_logp: TokenArray,
    advantages: TokenArray,
    mask: Mask,
    *,
    ref_logp: TokenArray | None = None,
    entropy: TokenArray | None = None,
    clip_eps: float = 3e-4,
    clip_eps_high: float | None = 4e-4,
    kl_coef: float = 0.0,
    kl_kind: str = "k3",
    entropy_coef: float = 0.0,
    agg: str = "seq-mean-token-mean",
    norm_len: int | None = None,
    token_weights: TokenArray | None = None,
    rows: Float[Array, ""] | None = None,
) -> tuple[Float[Array, ""], Stats]:
    """GSPO loss (Zheng et al. 2025): one importance ratio and one clip decision per sequence.

    s_i = exp(mean_t (logp - old_logp)) is the geometric mean of the token ratios over the
    response (length-normalised, so long and short responses clip alike), the sequence loss
    max(-A_i s_i, -A_i clip(s_i, 1 - eps, 1 + eps_high)) with A_i the sequence's advantage, then
    the mean over sequences. Token ratios vary too much to clip one by one when the reward is
    given per sequence; the paper clips at 3e-4 / 4e-4. The log-ratio is capped at 10 before
    the exponential, as verl. The KL term, if any, is added per token and averaged per sequence.

    With `token_weights` (a rollout correction's, constants) the loss takes verl's token form,
    s_i,t = sg(s_i) pi(y_t) / sg(pi(y_t)) (the same value and, unweighted, the same gradient), so
    each token's weight scales its own gradient: the per-token losses times the weights, averaged
    per sequence.
    """
    del rows  # a sequence mean counts the rows with tokens: empty packed slots have none
    if agg != "seq-mean-token-mean":
        raise ValueError(f"gspo averages per sequence; loss aggregation {agg!r} does not apply")
    high = clip_eps if clip_eps_high is None else clip_eps_high
    m = jnp.asarray(mask).astype(jnp.float32)
    has_tokens = (jnp.sum(m, axis=-1) > 0).astype(jnp.float32)
    rows = jnp.maximum(jnp.sum(has_tokens), 1.0)
    log_ratio = masked_mean((logp - old_logp).astype(jnp.float32), m, axis=-1)
    ratio = jnp.exp(jnp.minimum(log_ratio, 10.0))
    seq_adv = masked_mean(advantages.astype(jnp.float32), m, axis=-1)
    unclipped = -seq_adv * ratio
    clipped = -seq_adv * jnp.clip(ratio, 1.0 - clip_eps, 1.0 + high)
    seq_loss = jnp.maximum(unclipped, clipped)
    token_log_ratio = (logp - old_logp).astype(jnp.float32)
    stats: Stats = {
        "clipfrac": jnp.sum((clipped > unclipped) * has_tokens) / rows,
        "approx_kl": masked_mean(jnp.exp(token_log_ratio) - 1.0 - token_log_ratio, m),
        "ratio/mean": jnp.sum(ratio * has_tokens) / rows,
        "ratio/max": jnp.max(ratio * has_tokens),
    }
    if token_weights is None:
        loss = jnp.sum(seq_loss * has_tokens) / rows
    else:
        sg = jax.lax.stop_gradient
        s_tok = sg(ratio)[:, None] * jnp.exp(token_log_ratio - sg(token_log_ratio))
        a_tok = seq_adv[:, None]
        loss_tok = jnp.maximum(-a_tok * s_tok, -a_tok * jnp.clip(s_tok, 1.0 - clip_eps, 1.0 + high))
        loss = aggregate(loss_tok * token_weights, m, agg)
    kl = _kl_loss_term(logp, ref_logp, m, kl_coef, kl_kind, stats, "gspo")
    if kl is not None:
        loss = loss + aggregate(kl, m, agg)
    loss = loss + _entropy_term(entropy, m, agg, entropy_coef, stats)
    stats["loss/policy"] = loss
    return loss, jax.lax.stop_gradient(stats)


def value_loss(
    values: TokenArray,
    old_values: TokenArray,
    returns: TokenArray,
    mask: Mask,
    *,
    clip_eps: float | None = 0.2,
    agg: str = "token-mean",
) -> tuple[Float[Array, ""], Stats]:
    """Clipped value loss: 0.5 * max((V - R)^2, (V_clip - R)^2), V_clip = clip(V, V_old - eps, V_old + eps).

    Like the policy clip, it keeps the critic from moving far from the
    rollout-time values in one batch. All inputs in the critic's units (with
    value normalisation, `returns` normalised). `clip_eps=None` disables clipping.
    `value/clipfrac` is the share of tokens whose clipped term is the larger, as
    verl and TRL count it; V_clip is V itself inside the band (not V_old + (V - V_old),
    which rounds), so a token the clip leaves alone is never counted.
    """
    values = values.astype(jnp.float32)
    unclipped = jnp.square(values - returns)
    if clip_eps is None:
        loss_tok = unclipped
        clipfrac = jnp.zeros((), jnp.float32)
    else:
        clipped_values = jnp.clip(values, old_values - clip_eps, old_values + clip_eps)
        clipped = jnp.square(clipped_values - returns)
        loss_tok = jnp.maximum(unclipped, clipped)
        clipfrac = masked_mean((clipped > unclipped).astype(jnp.float32), mask)
    loss = 0.5 * aggregate(loss_tok, mask, agg)
    stats = {"loss/value": loss, "value/clipfrac": clipfrac, "value/mean": masked_mean(values, mask)}
    return loss, jax.lax.stop_gradient(stats)


def importance_ratio_exploded(
    logp: TokenArray, old_logp: TokenArray, mask: Mask, threshold: float = 5.0
) -> Bool[Array, ""]:
    """True when any response token's ratio exp(logp - old_logp) exceeds `threshold`.

    ReaLHF skips the update of a minibatch whose importance ratio exploded
    (default 5): the samples are too off-policy for the clipped objective to
    be trustworthy. The losses report the same number as `stats["ratio/max"]`.
    """
    return masked_max(jnp.exp((logp - old_logp).astype(jnp.float32)), mask) > threshold
