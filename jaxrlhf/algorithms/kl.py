"""KL to the reference policy: per-token estimators, the reward penalty, and controllers.

The policy is kept near the reference model by subtracting `coef * KL` from
every response token's reward (DESIGN §4, coef 0.1). The true KL of a token
distribution needs the full vocabulary; the estimators here use only the
log-prob of the sampled token under both models (Schulman, "Approximating KL
divergence", 2020), with x ~ policy and log r = ref_logp - logp:

- k1 = -log r = logp - ref_logp          unbiased, high variance, can be < 0
- k2 = (log r)^2 / 2                     biased, low variance, >= 0
- k3 = (r - 1) - log r                   unbiased, low variance, >= 0 ("low_var_kl")
"""

from __future__ import annotations

import difflib
from typing import Any, Callable

import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Float

from jaxrlhf.ppo.stats import last_token_onehot

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


KL_ESTIMATORS: dict[str, Callable[[TokenArray, TokenArray], TokenArray]] = {
    "k1": _k1,
    "k2": _k2,
    "k3": _k3,
}
KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}


def _estimator(kind: str) -> Callable[[TokenArray, TokenArray], TokenArray]:
    name = KL_ALIASES.get(kind, kind)
    if name not in KL_ESTIMATORS:
        known = sorted([*KL_ESTIMATORS, *KL_ALIASES])
        close = difflib.get_close_matches(kind, known, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown KL estimator {kind!r}.{hint} Known: {known}")
    return KL_ESTIMATORS[name]


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
    scores: Float[Array, "batch"],
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


@struct.dataclass
class FixedKLController:
    """A constant KL coefficient (the default, coef 0.1)."""

    value: float | Float[Array, ""] = 0.1

    def update(self, current_kl: float | Float[Array, ""], n_steps: int) -> "FixedKLController":
        """No-op, so the step engine can call `update` on any controller."""
        del current_kl, n_steps
        return self

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state for the checkpoint metadata."""
        return {"kind": "fixed", "value": float(self.value)}


@struct.dataclass
class AdaptiveKLController:
    """Ziegler et al. (2019) adaptive coefficient: steer the measured KL towards `target`.

    Each update multiplies the coefficient by
    `1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon`, so the KL
    error is corrected proportionally, at most 20 % per `horizon` samples.
    `n_steps` is the number of samples (sequences) the KL was measured on,
    as in TRL/ReaLHF. `current_kl` is the mean per-sequence KL (sum of
    per-token KL over the response, averaged over sequences).
    """

    value: float | Float[Array, ""]
    target: float = struct.field(pytree_node=False, default=6.0)
    horizon: float = struct.field(pytree_node=False, default=10000.0)

    def __post_init__(self):
        if self.target <= 0:
            raise ValueError(f"adaptive KL target must be > 0, got {self.target}")
        if self.horizon <= 0:
            raise ValueError(f"adaptive KL horizon must be > 0, got {self.horizon}")

    def update(self, current_kl: float | Float[Array, ""], n_steps: int) -> "AdaptiveKLController":
        """New controller after observing `current_kl` over `n_steps` samples (works under jit)."""
        error = jnp.clip(current_kl / self.target - 1.0, -0.2, 0.2)
        mult = 1.0 + error * n_steps / self.horizon
        return self.replace(value=self.value * mult)

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state for the checkpoint metadata."""
        return {"kind": "adaptive", "value": float(self.value), "target": self.target, "horizon": self.horizon}


KLController = FixedKLController | AdaptiveKLController


def build_kl_controller(
    kind: str = "fixed", coef: float = 0.1, target: float = 6.0, horizon: float = 10000.0
) -> KLController:
    """A controller from config values (`kind` is "fixed" or "adaptive")."""
    if kind == "fixed":
        return FixedKLController(value=coef)
    if kind == "adaptive":
        return AdaptiveKLController(value=coef, target=target, horizon=horizon)
    raise ValueError(f"unknown KL controller {kind!r}; choose 'fixed' or 'adaptive'")


def kl_controller_from_state(state: dict[str, Any]) -> KLController:
    """Inverse of `state_dict()`: rebuild a controller from checkpoint metadata."""
    if state.get("kind") == "adaptive":
        return AdaptiveKLController(
            value=float(state["value"]), target=float(state["target"]), horizon=float(state["horizon"])
        )
    if state.get("kind") == "fixed":
        return FixedKLController(value=float(state["value"]))
    raise ValueError(f"not a KL controller state: {state!r}")
