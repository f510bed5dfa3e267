"""What the preference stages (reward modelling, DPO) share: pair inputs and their forwards.

A batch row is one (chosen, rejected) pair, both left-padded to one length;
the loss masks mark the response tokens. Both sequences of a pair go through
the model in one forward of 2 x batch rows (chosen first).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from jaxrlhf.models.sampling import next_token_logprobs
from jaxrlhf.models.transformer import positions_from_mask


def pair_arrays(batch: Any) -> dict[str, Any]:
    """A `PreferenceBatch` as the named inputs of a pair call."""
    return {
        "chosen_tokens": batch.chosen_ids, "chosen_mask": batch.chosen_mask, "chosen_loss_mask": batch.chosen_loss_mask,
        "rejected_tokens": batch.rejected_ids, "rejected_mask": batch.rejected_mask,
        "rejected_loss_mask": batch.rejected_loss_mask,
    }


def _stacked(inputs: dict[str, Any], name: str) -> jax.Array:
    return jnp.concatenate([inputs[f"chosen_{name}"], inputs[f"rejected_{name}"]], axis=0)


def pair_scores(
    graphdef: nnx.GraphDef, params: nnx.State, inputs: dict[str, Any]
) -> tuple[Float[Array, " batch"], Float[Array, " batch"]]:
    """Reward-model scores of the chosen and the rejected sequence of every pair."""
    tokens, mask = _stacked(inputs, "tokens"), _stacked(inputs, "mask")
    scores = nnx.merge(graphdef, params)(tokens, positions_from_mask(mask), mask)
    return jnp.split(scores, 2)


def pair_logprobs(
    graphdef: nnx.GraphDef, params: nnx.State, inputs: dict[str, Any]
) -> tuple[Float[Array, "2 batch"], Float[Array, "2 batch"]]:
    """Summed log-probs of the response tokens of [chosen, rejected], and their token counts."""
    tokens, mask = _stacked(inputs, "tokens"), _stacked(inputs, "mask")
    logits, _ = nnx.merge(graphdef, params)(tokens, positions_from_mask(mask), mask)
    targets = _stacked(inputs, "loss_mask")[:, 1:].astype(jnp.float32)
    logp = jnp.sum(next_token_logprobs(logits, tokens) * targets, axis=1)
    b = inputs["chosen_tokens"].shape[0]
    return logp.reshape(2, b), jnp.sum(targets, axis=1).reshape(2, b)
