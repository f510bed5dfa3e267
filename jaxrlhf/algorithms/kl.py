"""KL to the reference policy: per-token estimators, the reward penalty, and controllers.

The policy is kept near the reference model by subtracting `coef * KL` from
every response token's reward (PPO, coef 0.1) or by a KL term in the
loss (GRPO); the coefficient is fixed or adapted towards a target KL
(`adaptive_kl_coef`, carried between steps as the `kl_coef` state). The true KL of a token
distribution needs the full vocabulary; the estimators here use only the
log-prob of the sampled token under both models (Schulman, "Approximating KL
divergence", 2020), with x ~ policy and log r = ref_logp - logp:

- k1 = -log r = logp - ref_logp          unbiased, high variance, can be < 0
- k2 = (log r)^2 / 2                     biased, low variance, >= 0
- k3 = (r - 1) - log r                   unbiased, low variance, >= 0 ("low_var_kl")
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from jaxrlhf.algorithms.stats import last_token_onehot
from jaxrlhf.registry import Registry

TokenArray = Float[Array, "batch time"]
Mask = Float[Array, "batch time"] | Bool[Array, "batch time"]


def _k1(logp: TokenArray, ref_logp: TokenArray) -> TokenArray:
    return logp - ref_logp


def _k2(logp: TokenArray, ref_logp: TokenArray) -> TokenArray:
    return 0.5 * jnp.square(logp - ref_logp)


def _k3(logp: TokenArray, ref_logp: TokenArray) -> TokenArray:
    # Clamp the log-ratio so exp() cannot overflow on a badly off-policy token.
    log_r = jnp.clip(ref_logp - logp, -20.0, 20.0)
    return jnp.exp(log_r) - log_r - 1.0


# k1..k3, and the names verl gives them
KL_ESTIMATORS: Registry[Callable[[TokenArray, TokenArray], TokenArray]] = Registry("KL estimator", entries={
    "k1": _k1, "k2": _k2, "k3": _k3, "kl": _k1, "mse": _k2, "low_var_kl": _k3,
})


def _estimator(kind: str) -> Callable[[TokenArray, TokenArray], TokenArray]:
    return KL_ESTIMATORS.get(kind)


def kl_per_token(
    logp: TokenArray, ref_logp: TokenArray, mask: Mask | None = None, kind: str = "k1"
) -> TokenArray:
    """Per-token KL(policy || reference) estimate; 0 outside `mask`.

    `kind` is "k1" (default, as ReaLHF/TRL's reward penalty), "k2" or "k3"
    (aliases "kl", "mse", "low_var_kl").
    """
    kl = _estimator(kind)(logp, ref_logp)
    if mask is not None:
        kl = kl * jnp.asarray(mask).astype(kl.dtype)
    return kl


def token_level_rewards(
    scores: Float[Array, " batch"],
    mask: Mask,
    kl: TokenArray | None = None,
    kl_coef: float | Float[Array, ""] = 0.0,
) -> TokenArray:
    """Token-level reward: the sequence score on the last response token, minus `kl_coef * kl` on every token.

    This is the reward GAE consumes. `scores` should already be shaped
    (`rewards.shape_scores`: bias/scale, clip, EOS gating). Positions outside
    `mask` are 0.
    """
    m = jnp.asarray(mask).astype(jnp.float32)
    rewards = scores.astype(jnp.float32)[:, None] * last_token_onehot(m)
    if kl is not None:
        rewards = rewards - kl_coef * kl * m
    return rewards


def adaptive_kl_coef(coef: float, kl: float, n_samples: int, target: float, horizon: float) -> float:
    """Ziegler et al. (2019) adaptive coefficient after observing mean per-sequence KL `kl` over
    `n_samples` sequences: `coef * (1 + clip(kl / target - 1, -0.2, 0.2) * n_samples / horizon)`."""
    if target <= 0 or horizon <= 0:
        raise ValueError(f"adaptive KL needs target > 0 and horizon > 0, got {target}, {horizon}")
    error = min(max(kl / target - 1.0, -0.2), 0.2)
    return float(coef * (1.0 + error * n_samples / horizon))
