"""Log-probs and entropies of read positions, from hidden states in chunks of positions.

Why: the float32 full-vocabulary logits are the largest activation of a log-prob call. At 60k tokens a
device and a 152k vocabulary they are 37 GB a copy, and a train call keeps about three (the logits, their
softmax and their gradient). Computing the head, log-softmax, log-prob and entropy for a chunk of positions
at a time, and recomputing each chunk's logits in the backward (`jax.checkpoint`) rather than saving them,
keeps one chunk's logits alive at a time: the memory verl's chunked entropy and Liger's fused linear
cross-entropy save, in plain JAX. The results are the unchunked ones up to float summation order.

A chunk takes every n-th position of each row (positions j, j + n, j + 2n, ...; the length padded to a
multiple of n): its [rows, length / n] slice keeps the activations' batch and length sharding, so no device
gathers another's positions. The planner's memory model counts a chunk's logits with the same sizes (`logit_sizes`).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxrlhf.models import axes as ax
from jaxrlhf.models.logit_sizes import chunk_count
from jaxrlhf.models.sampling import SamplingParams, process_logits


def chunked_token_stats(
    head: Callable[[jax.Array], jax.Array],
    hidden: Float[Array, "rows length embed"],
    targets: Int[Array, "rows length"],
    params: SamplingParams,
    budget: int | None,
    with_entropy: bool = True,
) -> tuple[Float[Array, "rows length"], Float[Array, "rows length"] | None]:
    """(log-prob of `targets`, entropy) at every position of `hidden` under the processed distribution
    (`sampling.process_logits`), where `head` maps hidden states to logits. `hidden[:, t]` must be the
    state that predicts `targets[:, t]`. The entropy is None without `with_entropy`."""
    rows, length = targets.shape
    n = chunk_count(rows, length, budget, ax.batch_ways(), ax.length_ways())

    def stats(h, t):
        h = ax.constrain(h, (ax.BATCH, ax.LENGTH, ax.EMBED))
        logp = process_logits(head(h), params)
        token = jnp.take_along_axis(logp, t[..., None].astype(jnp.int32), axis=-1)[..., 0]
        if not with_entropy:
            return token, None
        p = jnp.exp(logp)
        return token, -jnp.sum(p * jnp.where(p > 0, logp, 0.0), axis=-1)

    if n == 1:
        return stats(hidden, targets)
    # padded (zero states, read nowhere) to a length whose n chunks split evenly over the context devices
    padded = -(-length // (n * ax.length_ways())) * n * ax.length_ways()
    hidden = jnp.pad(hidden, ((0, 0), (0, padded - length), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, padded - length)))
    # [rows, padded / n, n, ...] -> [n, rows, padded / n, ...]: chunk j holds positions j, j + n, ...
    hs = jnp.moveaxis(hidden.reshape(rows, padded // n, n, hidden.shape[-1]), 2, 0)
    ts = jnp.moveaxis(targets.reshape(rows, padded // n, n), 2, 0)
    out = jax.lax.map(jax.checkpoint(lambda xs: stats(*xs)), (hs, ts))

    def unchunk(x):
        return None if x is None else jnp.moveaxis(x, 0, 2).reshape(rows, padded)[:, :length]

    return unchunk(out[0]), unchunk(out[1])
