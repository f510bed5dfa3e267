"""Logits processing shared by sampling and by training-time log-prob recomputation.

The RL losses need the behaviour log-probs (recorded while sampling) and the training
log-probs (recomputed by a forward pass) to come from the *same*
distribution, so both go through `process_logits`. The order is fixed and
matches Hugging Face's warpers:

1. divide by `temperature`;
2. top-k: keep logits >= the k-th largest (ties at the threshold are kept);
3. top-p: keep the smallest set of most likely tokens (under the distribution
   after steps 1-2) whose probability mass reaches `top_p`; the most likely
   token is always kept;
4. log-softmax over the kept tokens, -inf elsewhere.

Greedy decoding picks the argmax of the raw logits (the same token the
processed distribution ranks first); its log-probs are still those of the
processed distribution, so `greedy` never changes a log-prob.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to turn logits into a token. Hashable: it is a static argument of the jitted decode.

    `top_k=0` and `top_p=1.0` switch the respective filter off.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (use greedy=True for argmax), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


GREEDY = SamplingParams(greedy=True)


def _keep_mask(scaled: Float[Array, "... vocab"], params: SamplingParams) -> Bool[Array, "... vocab"] | None:
    """Boolean mask of the tokens top-k / top-p keep, or None when both are off."""
    scaled = jax.lax.stop_gradient(scaled)  # masks are piecewise constant: no gradient flows through them
    vocab = scaled.shape[-1]
    keep = None
    if 0 < params.top_k < vocab:
        kth = jax.lax.top_k(scaled, params.top_k)[0][..., -1:]
        keep = scaled >= kth
    if params.top_p < 1.0:
        masked = scaled if keep is None else jnp.where(keep, scaled, -jnp.inf)
        sorted_desc = -jnp.sort(-masked, axis=-1)
        probs = jax.nn.softmax(sorted_desc, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs  # exclusive cumulative mass
        kept_sorted = mass_before < params.top_p  # first entry always kept (mass_before = 0)
        # Smallest kept logit is the threshold; comparing against it avoids a scatter back to vocab order.
        threshold = jnp.min(jnp.where(kept_sorted, sorted_desc, jnp.inf), axis=-1, keepdims=True)
        top_p_keep = masked >= threshold
        keep = top_p_keep if keep is None else keep & top_p_keep
    return keep


def process_logits(
    logits: Float[Array, "... vocab"], params: SamplingParams
) -> Float[Array, "... vocab"]:
    """Log-probs of the processed distribution (temperature, top-k, top-p; -inf where filtered)."""
    scaled = logits.astype(jnp.float32) / params.temperature
    keep = _keep_mask(scaled, params)
    if keep is not None:
        scaled = jnp.where(keep, scaled, -jnp.inf)
    return jax.nn.log_softmax(scaled, axis=-1)


def sample(
    rng: PRNGKeyArray, logits: Float[Array, "batch vocab"], params: SamplingParams
) -> tuple[Int[Array, " batch"], Float[Array, " batch"]]:
    """Draw one token per row; returns (tokens, their log-probs under the processed distribution)."""
    logp = process_logits(logits, params)
    if params.greedy:
        tokens = jnp.argmax(logits, axis=-1)
    else:
        tokens = jax.random.categorical(rng, logp, axis=-1)
    tokens = tokens.astype(jnp.int32)
    return tokens, jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]


def token_logprobs(
    logits: Float[Array, "batch length vocab"],
    tokens: Int[Array, "batch length"],
    params: SamplingParams,
) -> Float[Array, "batch length"]:
    """Log-prob of `tokens` under the processed distribution: the training-side twin of `sample`.

    `logits[:, t]` must be the logits that predicted `tokens[:, t]` (i.e. shifted by one).
    """
    logp = process_logits(logits, params)
    return jnp.take_along_axis(logp, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]


def response_logprobs(
    logits: Float[Array, "batch total vocab"],
    response_tokens: Int[Array, "batch new"],
    response_mask: Bool[Array, "batch new"],
    params: SamplingParams,
) -> Float[Array, "batch new"]:
    """Log-probs of the response from a full-sequence forward (prompt then response): the
    logits at position P-1+t predict response token t. 0 where the response is masked."""
    p = logits.shape[1] - response_tokens.shape[1]
    lp = token_logprobs(logits[:, p - 1 : -1], response_tokens, params)
    return jnp.where(response_mask, lp, 0.0)


def entropy(logits: Float[Array, "... vocab"], params: SamplingParams) -> Float[Array, "..."]:
    """Entropy of the processed distribution; filtered tokens contribute 0 (and no NaN gradients)."""
    logp = process_logits(logits, params)
    p = jnp.exp(logp)
    safe_logp = jnp.where(p > 0, logp, 0.0)
    return -jnp.sum(p * safe_logp, axis=-1)


def next_token_logprobs(
    logits: Float[Array, "batch length vocab"], tokens: Int[Array, "batch length"]
) -> Float[Array, "batch length-1"]:
    """log p(tokens[:, t + 1] | tokens[:, :t + 1]) under the plain (unprocessed) distribution:
    what supervised losses, DPO and reward-free scoring use."""
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, tokens[:, 1:, None].astype(jnp.int32), axis=-1)[..., 0]
