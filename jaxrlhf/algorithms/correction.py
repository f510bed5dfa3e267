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
  the kept tokens still weighted by rho_t; [alpha, beta] = [0.5, 5] by default, the paper's band).
- `seq_mask`: a whole response is dropped unless its geometric-mean ratio of behaviour to trainer,
  exp(-mean_t log rho_t), lies in [low, high] (verl's geometric rejection sampling, `rollout_rs:
  seq_mean_k1`, which bands mean_t -log rho_t); low defaults to 1 / high, as verl derives a lower bound
  from a single threshold; no weight.
- `decoupled`: w_t = rho_t (AReaL's decoupled PPO: clip against the proximal policy, weight by
  proximal / behaviour); with a cap, tokens whose rho_t exceeds it get weight 0 (AReaL's
  `behav_imp_weight_cap`).

Each kind is a function registered in `ROLLOUT_CORRECTIONS` (how to add one: docs/architecture.md, "A
new rollout correction").

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
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from jaxrlhf.algorithms.kl import kl_per_token
from jaxrlhf.algorithms.stats import masked_max, masked_mean
from jaxrlhf.registry import Registry

TokenArray = Float[Array, "batch time"]
Mask = Bool[Array, "batch time"]

LOG_BOUND = 20.0  # |log rho| is clamped here before the exponential (exp(20) ~ 5e8), as verl's safety bound


@dataclasses.dataclass(frozen=True)
class Correction:
    """Which correction and its parameters (static: part of the train call's compile key). Every field but
    `kind` is an `algorithm` key of the same name (`Correction.from_config` reads them)."""

    kind: str = "none"
    tis_cap: float = 2.0  # C
    icepop_low: float = 0.5  # alpha
    icepop_high: float = 5.0  # beta: the IcePop paper's [0.5, 5]
    seq_mask_low: float | None = None  # None: 1 / seq_mask_high (verl's lower bound from one threshold)
    seq_mask_high: float = 1.001
    decoupled_cap: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in ROLLOUT_CORRECTIONS:
            raise ValueError(ROLLOUT_CORRECTIONS.unknown(self.kind))

    @classmethod
    def from_config(cls, algorithm: Any) -> "Correction":
        """`algorithm.rollout_correction` and every parameter field the config's `algorithm` section has."""
        params = {f.name: getattr(algorithm, f.name) for f in dataclasses.fields(cls)
                  if f.name != "kind" and hasattr(algorithm, f.name)}
        return cls(kind=algorithm.rollout_correction, **params)

    @property
    def active(self) -> bool:
        """Whether the train call recomputes pi_old (every kind but `none`)."""
        return self.kind != "none"

    @property
    def seq_mask_band(self) -> tuple[float, float]:
        """`seq_mask`'s [low, high] on exp(-mean_t log rho_t), the low edge derived when unset."""
        return (1.0 / self.seq_mask_high if self.seq_mask_low is None else self.seq_mask_low), self.seq_mask_high


@dataclasses.dataclass(frozen=True)
class Corrected:
    """What one kind makes of a batch: token weights (None: no weight), the loss mask the loss aggregates over,
    and for the statistics the tokens it zeroed (`dropped`) and the tokens whose weight it truncated."""

    weights: TokenArray | None
    loss_mask: Mask
    dropped: Mask
    truncated: Mask


# kind -> fn(correction, log_rho, rho, mask) -> Corrected; `log_rho` is 0 off `mask`, `rho` its clamped exp
CorrectionFn = Callable[[Correction, TokenArray, TokenArray, Mask], Corrected]
ROLLOUT_CORRECTIONS: Registry[CorrectionFn] = Registry("rollout correction")
register_correction = ROLLOUT_CORRECTIONS.register


def _nothing(mask: Mask) -> Mask:
    return jnp.zeros(mask.shape, bool)


@register_correction("none")
def no_correction(c: Correction, log_rho: TokenArray, rho: TokenArray, mask: Mask) -> Corrected:
    """The ratio against the behaviour log-probs as sampled: nothing weighted, nothing masked."""
    return Corrected(None, mask, _nothing(mask), _nothing(mask))


@register_correction("tis")
def truncated_is(c: Correction, log_rho: TokenArray, rho: TokenArray, mask: Mask) -> Corrected:
    """w_t = min(rho_t, C)."""
    truncated = mask & (log_rho > math.log(c.tis_cap))
    return Corrected(jnp.where(mask, jnp.minimum(rho, c.tis_cap), 0.0), mask, _nothing(mask), truncated)


@register_correction("icepop")
def icepop(c: Correction, log_rho: TokenArray, rho: TokenArray, mask: Mask) -> Corrected:
    """w_t = rho_t inside [alpha, beta] (edges kept), 0 outside; a zeroed token stays in the normaliser."""
    keep = (log_rho >= math.log(c.icepop_low)) & (log_rho <= math.log(c.icepop_high))
    return Corrected(jnp.where(mask & keep, rho, 0.0), mask, mask & ~keep, _nothing(mask))


@register_correction("decoupled")
def decoupled(c: Correction, log_rho: TokenArray, rho: TokenArray, mask: Mask) -> Corrected:
    """w_t = rho_t; with a cap, 0 where rho_t exceeds it (AReaL)."""
    keep = jnp.ones(mask.shape, bool) if c.decoupled_cap is None else log_rho <= math.log(c.decoupled_cap)
    return Corrected(jnp.where(mask & keep, rho, 0.0), mask, mask & ~keep, _nothing(mask))


@register_correction("seq_mask")
def sequence_mask(c: Correction, log_rho: TokenArray, rho: TokenArray, mask: Mask) -> Corrected:
    """A response leaves the loss mask unless low <= exp(-mean_t log rho_t) <= high (verl's seq_mean_k1)."""
    low, high = c.seq_mask_band
    behaviour_over_old = -masked_mean(log_rho, mask, axis=-1)
    keep_row = (behaviour_over_old >= math.log(low)) & (behaviour_over_old <= math.log(high))
    return Corrected(None, mask & keep_row[:, None], mask & ~keep_row[:, None], _nothing(mask))


KINDS = tuple(ROLLOUT_CORRECTIONS)


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
    out = ROLLOUT_CORRECTIONS.get(c.kind)(c, log_rho, rho, mask)
    weights, loss_mask, dropped, truncated = out.weights, out.loss_mask, out.dropped, out.truncated
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
