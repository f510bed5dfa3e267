"""Off-policy rollout correction (`algorithm.rollout_correction`): the behaviour log-probs recorded at
sampling time against the log-probs the trainer recomputes before its update.

Three policies meet in an RL step: the behaviour policy pi_behav that sampled the rollout (its
log-probs are `behaviour_logp`, recorded by the generate call), the trainer's policy before the
update, pi_old ("proximal" in AReaL; `old_logp`, recomputed by the `actor.inference` call), and the
policy being updated, pi_theta. Without a correction (`none`) pi_old is taken to be pi_behav: the
PPO ratio is pi_theta / pi_behav. Any other kind recomputes pi_old, clips the PPO ratio
pi_theta / pi_old, and corrects for the gap between pi_old and pi_behav with the per-token ratio

    rho_t = pi_old(y_t) / pi_behav(y_t) = exp(old_logp_t - behaviour_logp_t)

which a stale sampler (asynchronous generation) or a different numerical path (bf16 generation,
another kernel or engine) moves away from 1:

- `tis`: w_t = min(rho_t, C), a weight on each token's policy loss (truncated importance
  sampling; Yao et al. 2025, verl's `rollout_is: token`).
- `icepop`: w_t = rho_t if alpha <= rho_t <= beta else 0 (IcePop, Ring-1T: double-sided masking,
  the kept tokens still weighted by rho_t).
- `seq_mask`: a whole response is dropped when its geometric-mean ratio
  exp(mean_t log rho_t) leaves [low, high] (verl's geometric rejection sampling); no weight.
- `decoupled`: w_t = rho_t (AReaL's decoupled PPO: clip against the proximal policy, weight by
  proximal / behaviour); with a cap, tokens whose rho_t exceeds it get weight 0 (AReaL's
  `behav_imp_weight_cap`).

Bands are inclusive at both edges and compared in log space (log rho_t against log alpha, ...), so
a ratio exactly at an edge is kept. Weights are constants of the loss (no gradient flows through
pi_old or pi_behav) and multiply the clipped surrogate only, not the KL or entropy terms.

What masked tokens do to the loss's normaliser follows each source: a token IcePop or the
decoupled cap zeroes stays in the denominator (the paper's 1/|y_i|, AReaL's loss-mask count): it
carries no loss but still counts; a sequence `seq_mask` drops leaves the loss mask (verl's
modified `response_mask`): its tokens count for nothing, as if it had not been sampled (under
`seq-mean-token-sum-norm`, whose normaliser is the constant rows x max_new_tokens, it still counts
as a row). Advantages, rewards and the KL reward are computed from the unmodified rollout.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from jaxrlhf.algorithms.kl import kl_per_token
from jaxrlhf.algorithms.stats import masked_max, masked_mean

TokenArray = Float[Array, "batch time"]
Mask = Bool[Array, "batch time"]

KINDS = ("none", "tis", "seq_mask", "icepop", "decoupled")
LOG_BOUND = 20.0  # |log rho| is clamped here before the exponential (exp(20) ~ 5e8), as verl's safety bound


@dataclasses.dataclass(frozen=True)
class Correction:
    """Which correction and its parameters (static: part of the train call's compile key)."""

    kind: str = "none"
    tis_cap: float = 2.0  # C
    icepop_low: float = 0.5  # alpha
    icepop_high: float = 2.0  # beta
    seq_mask_low: float = 0.999
    seq_mask_high: float = 1.001
    decoupled_cap: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown rollout correction {self.kind!r}; choose one of {KINDS}")

    @property
    def active(self) -> bool:
        """Whether the train call recomputes pi_old (every kind but `none`)."""
        return self.kind != "none"


def behaviour_logp(inputs: dict[str, Any], kind: str) -> TokenArray:
    """The rollout's behaviour log-probs, or one line naming the key when a correction has none to use."""
    if "behaviour_logp" not in inputs:
        raise ValueError(
            f"algorithm.rollout_correction={kind} compares the recomputed log-probs with the behaviour log-probs "
            "recorded at sampling time, but this rollout has no 'behaviour_logp'; set algorithm.rollout_correction=none")
    return inputs["behaviour_logp"]


def correction_weights(
    c: Correction, old_logp: TokenArray, behaviour: TokenArray, mask: Mask
) -> tuple[TokenArray | None, Mask, dict[str, Float[Array, ""]]]:
    """(token weights or None, loss mask, stats) of correction `c` over a batch's response tokens `mask`.

    The weights multiply each token's policy loss (None: no weight, `seq_mask`); the loss mask is the
    one the loss aggregates over (`mask` itself except for `seq_mask`). The stats, over the response
    tokens: `correction/kl_behaviour` (k3 estimate of KL(pi_behav || pi_old) from the sampled tokens),
    `correction/is_weight_{mean,max,min}` (rho_t before truncation or masking),
    `correction/masked_fraction` (tokens that carry no loss because of the correction) and
    `correction/truncated_fraction` (tokens whose weight `tis` truncated at C)."""
    mask = jnp.asarray(mask).astype(bool)
    log_rho = jnp.where(mask, (old_logp - behaviour).astype(jnp.float32), 0.0)
    rho = jnp.exp(jnp.clip(log_rho, -LOG_BOUND, LOG_BOUND))
    zero = jnp.zeros(mask.shape, bool)
    weights: TokenArray | None = None
    loss_mask, dropped, truncated = mask, zero, zero
    if c.kind == "tis":
        truncated = mask & (log_rho > math.log(c.tis_cap))
        weights = jnp.where(mask, jnp.minimum(rho, c.tis_cap), 0.0)
    elif c.kind == "icepop":
        keep = (log_rho >= math.log(c.icepop_low)) & (log_rho <= math.log(c.icepop_high))
        dropped = mask & ~keep
        weights = jnp.where(mask & keep, rho, 0.0)
    elif c.kind == "decoupled":
        keep = jnp.ones(mask.shape, bool) if c.decoupled_cap is None else log_rho <= math.log(c.decoupled_cap)
        dropped = mask & ~keep
        weights = jnp.where(mask & keep, rho, 0.0)
    elif c.kind == "seq_mask":
        log_geo = masked_mean(log_rho, mask, axis=-1)
        keep_row = (log_geo >= math.log(c.seq_mask_low)) & (log_geo <= math.log(c.seq_mask_high))
        loss_mask = mask & keep_row[:, None]
        dropped = mask & ~keep_row[:, None]
    elif c.kind != "none":
        raise ValueError(f"unknown rollout correction {c.kind!r}; choose one of {KINDS}")
    stats = {
        "correction/kl_behaviour": masked_mean(kl_per_token(behaviour, old_logp, mask, kind="k3"), mask),
        "correction/is_weight_mean": masked_mean(rho, mask),
        "correction/is_weight_max": masked_max(rho, mask),
        "correction/is_weight_min": -masked_max(-rho, mask),
        "correction/masked_fraction": masked_mean(dropped.astype(jnp.float32), mask),
        "correction/truncated_fraction": masked_mean(truncated.astype(jnp.float32), mask),
    }
    if weights is not None:
        weights = jax.lax.stop_gradient(weights)
    return weights, loss_mask, jax.lax.stop_gradient(stats)
