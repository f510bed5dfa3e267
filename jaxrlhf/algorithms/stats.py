"""Masked statistics over token-level [batch, time] arrays.

Every RL loss and statistic is averaged over *response tokens only*, so every reduction
here takes a mask (float or bool, 1 = real response token). The reductions are
plain `jnp.sum` over the whole array: under `jax.jit` with batch-sharded inputs
XLA (GSPMD) inserts the cross-device all-reduce itself, so `masked_whiten` on a
sharded global batch whitens with the *global* mean and variance, never a
per-shard one (advantages are whitened over the whole global batch).
Call these on the global batch inside jit, not on per-device shards inside
`shard_map`, or the statistics become local.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Float

Mask = Float[Array, "batch time"] | Bool[Array, "batch time"]


def _as_float(mask: Array, like: Array) -> Array:
    return jnp.asarray(mask).astype(jnp.result_type(like, jnp.float32))


def masked_sum(
    x: Float[Array, "batch time"], mask: Mask, axis: int | None = None
) -> Float[Array, "..."]:
    """Sum of `x` over masked-in entries (all of them, or along `axis`)."""
    return jnp.sum(x * _as_float(mask, x), axis=axis)


def masked_count(mask: Mask, axis: int | None = None) -> Float[Array, "..."]:
    """Number of masked-in entries (as float, so it can divide)."""
    return jnp.sum(jnp.asarray(mask).astype(jnp.float32), axis=axis)


def masked_mean(
    x: Float[Array, "batch time"], mask: Mask, axis: int | None = None
) -> Float[Array, "..."]:
    """Mean over masked-in entries; 0 where nothing is masked in (no NaN from 0/0)."""
    total = masked_sum(x, mask, axis)
    count = masked_count(mask, axis)
    return jnp.where(count > 0, total / jnp.maximum(count, 1.0), 0.0)


def masked_var(
    x: Float[Array, "batch time"], mask: Mask, unbiased: bool = False
) -> Float[Array, ""]:
    """Variance over all masked-in entries.

    Population variance by default (as ReaLHF's masked normalisation); with
    `unbiased=True` the Bessel-corrected estimate (as TRL), which needs >= 2 entries.
    """
    mean = masked_mean(x, mask)
    count = masked_count(mask)
    sq = masked_sum(jnp.square(x - mean), mask)
    denom = count - 1.0 if unbiased else count
    return jnp.where(denom > 0, sq / jnp.maximum(denom, 1.0), 0.0)


def masked_whiten(
    x: Float[Array, "batch time"],
    mask: Mask,
    shift_mean: bool = True,
    eps: float = 1e-8,
    unbiased: bool = False,
) -> Float[Array, "batch time"]:
    """Normalise `x` to unit variance (and zero mean) over all masked-in tokens.

    Used on advantages so the policy-gradient scale does not depend on the
    reward scale. With `shift_mean=False` only the scale changes (the mean is
    added back), which keeps the sign of every advantage. Entries outside the
    mask are set to 0 so they cannot leak into later sums. Statistics are over
    the whole (global, if sharded under jit) array — see the module docstring.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=unbiased)
    whitened = (x - mean) * jax.lax.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * _as_float(mask, x)


def masked_max(x: Float[Array, "batch time"], mask: Mask) -> Float[Array, ""]:
    """Max over masked-in entries; -inf when nothing is masked in."""
    return jnp.max(jnp.where(jnp.asarray(mask).astype(bool), x, -jnp.inf))


def last_token_onehot(mask: Mask) -> Float[Array, "batch time"]:
    """One-hot of the last masked-in position of each row (all zeros for an empty row).

    Where a sequence-level score goes in a token-level reward. Works for any
    mask shape, not only right-padded ones.
    """
    m = jnp.asarray(mask).astype(bool)
    length = m.shape[-1]
    # index of the last True: T-1 - (first True in the reversed row)
    last = length - 1 - jnp.argmax(m[..., ::-1], axis=-1)
    onehot = jax.nn.one_hot(last, length, dtype=jnp.float32)
    return onehot * jnp.any(m, axis=-1, keepdims=True).astype(jnp.float32)


@struct.dataclass
class RunningMoments:
    """EMA of mean and mean-square, debiased: the value-normalisation state.

    A pytree of three float32 scalars (checkpointable as-is). The critic
    predicts normalised values; `denormalize` turns its outputs into reward
    units before GAE, and `normalize` maps the returns back into the critic's
    units for the value loss. `beta` close to 1 gives a slowly moving scale,
    so the value targets do not jump from batch to batch. Debiasing (as in
    Adam) makes the very first update exact instead of shrunk towards 0.
    """

    mean_acc: Float[Array, ""]
    sq_acc: Float[Array, ""]
    debias: Float[Array, ""]
    beta: float = struct.field(pytree_node=False, default=0.99995)
    eps: float = struct.field(pytree_node=False, default=1e-5)

    @classmethod
    def create(cls, beta: float = 0.99995, eps: float = 1e-5) -> "RunningMoments":
        """Empty state (no batch seen yet: mean 0, std 1)."""
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"RunningMoments beta must be in [0, 1), got {beta}")
        zero = jnp.zeros((), jnp.float32)
        return cls(mean_acc=zero, sq_acc=zero, debias=zero, beta=beta, eps=eps)

    @property
    def mean(self) -> Float[Array, ""]:
        return jnp.where(self.debias > 0, self.mean_acc / jnp.maximum(self.debias, 1e-12), 0.0)

    @property
    def var(self) -> Float[Array, ""]:
        mean_sq = jnp.where(self.debias > 0, self.sq_acc / jnp.maximum(self.debias, 1e-12), 1.0)
        return jnp.maximum(mean_sq - jnp.square(self.mean), 0.0)

    @property
    def std(self) -> Float[Array, ""]:
        return jnp.sqrt(self.var + self.eps)

    def update(self, x: Float[Array, "batch time"], mask: Mask) -> "RunningMoments":
        """Fold in the masked mean and mean-square of one (global) batch."""
        batch_mean = masked_mean(x, mask)
        batch_sq = masked_mean(jnp.square(x), mask)
        b = self.beta
        return self.replace(
            mean_acc=b * self.mean_acc + (1.0 - b) * batch_mean,
            sq_acc=b * self.sq_acc + (1.0 - b) * batch_sq,
            debias=b * self.debias + (1.0 - b),
        )

    def normalize(self, x: Float[Array, "..."]) -> Float[Array, "..."]:
        """Reward units -> critic units."""
        return (x - self.mean) / self.std

    def denormalize(self, x: Float[Array, "..."]) -> Float[Array, "..."]:
        """Critic units -> reward units."""
        return x * self.std + self.mean
