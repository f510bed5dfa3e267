"""Score shaping on device: bias/scale, clip and the EOS gate for rule and reward-model scores
alike, and DAPO's soft overlong penalty. The rule rewards themselves are `jaxrlhf.rewards.rules`.
"""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from jaxrlhf.algorithms.stats import last_token_onehot

# ---------------------------------------------------------------- shaping


def sequence_ended_with_eos(
    tokens: Int[Array, "batch time"],
    mask: Float[Array, "batch time"] | Bool[Array, "batch time"],
    eos_token_id: int | Sequence[int],
) -> Bool[Array, " batch"]:
    """True where the last response token is an EOS (the model chose to stop, it was not cut off).

    `eos_token_id` may list several ids (Llama 3.1 ends turns with any of three); each counts.
    """
    onehot = last_token_onehot(mask)
    eos_ids = [eos_token_id] if isinstance(eos_token_id, (int, np.integer)) else list(eos_token_id)
    is_eos = jnp.isin(tokens, jnp.asarray(eos_ids, jnp.int32)).astype(jnp.float32)
    return jnp.sum(is_eos * onehot, axis=-1) > 0


def shape_scores(
    scores: Float[Array, " batch"],
    ended_with_eos: Bool[Array, " batch"] | None = None,
    *,
    bias: float = 0.0,
    scale: float = 1.0,
    clip: float | None = 20.0,
    eos_only: bool = True,
    no_eos_score: float = 0.0,
) -> Float[Array, " batch"]:
    """(score - bias) * scale, clipped to ±clip; `no_eos_score` for sequences that did not end with EOS.

    Used for reward-model and rule scores alike (ReaLHF defaults):
    the bias/scale put the reward model's output on a sane scale, the clip
    stops one outlier from dominating a batch, and a truncated sequence gets
    no credit (a reward model scores half an answer unreliably). Set
    `eos_only=False` to keep the score of truncated sequences.
    """
    shaped = (jnp.asarray(scores, jnp.float32) - bias) * scale
    if clip is not None:
        if clip <= 0:
            raise ValueError(f"reward clip must be > 0 or None, got {clip}")
        shaped = jnp.clip(shaped, -clip, clip)
    if eos_only:
        if ended_with_eos is None:
            raise ValueError("shape_scores(eos_only=True) needs ended_with_eos")
        shaped = jnp.where(jnp.asarray(ended_with_eos), shaped, jnp.float32(no_eos_score))
    return shaped


def overlong_penalty(
    lengths: Int[Array, " batch"] | Float[Array, " batch"], *, max_len: int, buffer: int, penalty: float = 1.0
) -> Float[Array, " batch"]:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): 0 up to `max_len - buffer` response
    tokens, then falling linearly to `-penalty` at `max_len`.

    A hard cut-off gives a correct answer that ran a little long the same score as nonsense; the
    ramp tells the policy that length costs before it costs everything. `lengths` count the
    response tokens including the EOS token (verl's valid response length).
    """
    if not 0 < buffer <= max_len:
        raise ValueError(f"overlong buffer must be in (0, max_new_tokens={max_len}], got {buffer}")
    excess = jnp.asarray(lengths, jnp.float32) - (max_len - buffer)
    return -penalty * jnp.clip(excess / buffer, 0.0, 1.0)
