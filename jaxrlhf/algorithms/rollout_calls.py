"""The model calls of RL from rollouts that read a sampled batch: the static settings every call is bound with
(`RLSettings`), the forwards that read response positions (padded or packed rows), and the inference calls
(policy and reference log-probs, critic values, reward-model scores). The generate call is the rollout's
(`jaxrlhf.rollouts`), the train calls `rollout_train`'s, the host steps `rollout_host`'s.

Conventions for a batch of sequences [B, L] = left-padded prompt (P tokens) followed by the response (N
tokens, right-padded): the logits at position P-1+t predict response token t, and the critic's value at the
same position is V(s_t), the value of the state *before* response token t.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from jaxrlhf.algorithms.base import AlgorithmConfigError
from jaxrlhf.algorithms.correction import Correction
from jaxrlhf.algorithms.update import map_microbatches, map_packed
from jaxrlhf.models import pipeline
from jaxrlhf.models.logit_chunks import chunked_token_stats
from jaxrlhf.models.moe import replaying
from jaxrlhf.models.sampling import SamplingParams
from jaxrlhf.rollouts import RESPONSE, ROUTED


@dataclasses.dataclass(frozen=True)
class RLSettings:
    """Static settings of the rollout calls (hashable: part of every compile key)."""

    estimator: str
    loss: str = "ppo"
    group_size: int = 1
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std: bool = True
    whiten: bool = False  # only for estimators whose whitening is optional (GAE)
    clip_eps: float = 0.2
    clip_eps_high: float | None = None  # None = clip_eps (symmetric); DAPO decouples them
    value_clip_eps: float | None = 0.2
    kl_estimator: str = "k1"
    kl_in_reward: bool = True
    kl_in_loss: bool = False
    loss_agg: str = "token-mean"
    max_new_tokens: int = 32
    minibatches: int = 4
    epochs: int = 1
    micro_batch: int | None = None  # rows per micro-batch in train and inference calls
    ratio_early_stop: float | None = 5.0
    normalize_values: bool = False
    entropy_coef: float = 0.0
    sampling: SamplingParams = SamplingParams()
    reward_bias: float = 0.0
    reward_scale: float = 1.0
    reward_clip: float | None = 20.0
    eos_only: bool = True
    overlong_buffer: int = 0  # DAPO's soft overlong punishment over the last N tokens; 0 = off
    overlong_penalty: float = 1.0
    ignore_eos: bool = False  # generation.ignore_eos: responses run to max_new_tokens past any EOS
    engine: str = "static"  # generation.engine (models/engines.py)
    slots: int | None = None  # generation.slots (continuous engine)
    kv_pages: int | None = None  # generation.kv_pages (continuous engine)
    correction: Correction = Correction()  # algorithm.rollout_correction and its parameters
    # a mixture-of-experts actor: the load-balancing loss's weight (algorithm.router_aux_loss_coef) and the
    # experts per token; experts = 0 for a dense actor (no router statistics)
    router_aux_coef: float = 0.0
    router_top_k: int = 0
    router_replay: bool = False  # algorithm.router_replay: the generate call records experts, the actor replays them
    logit_chunk: int | None = None  # algorithm.logit_chunk_tokens: positions a device whose logits are built at once


def sampling_params(cfg: Any) -> SamplingParams:
    gen = cfg.generation
    return SamplingParams(temperature=gen.temperature, top_k=gen.top_k, top_p=gen.top_p, greedy=gen.greedy)



def _response_slice(x: jax.Array, prompt_len: int) -> jax.Array:
    """Outputs at positions P-1 .. L-2: the ones that predict (or value) response tokens."""
    return x[:, prompt_len - 1 : -1]


def packed_output(model: nnx.Module, batch: dict[str, Any], at: str = "read") -> jax.Array:
    """A model's outputs on a packed micro-batch (`update.packed_micro_batch`), read at the positions
    `at` names ("read": those that predict each response token, [slots, N, ...]; "last": each
    sequence's last token, [slots, ...])."""
    pk = batch["packed"]
    out = model(pk["tokens"], pk["positions"], pk["segments"] > 0, segment_ids=pk["segments"], read_at=pk[at])
    return out[0] if isinstance(out, tuple) else out


def response_hidden(model: nnx.Module, batch: dict[str, Any], prompt_len: int) -> Float[Array, "rows reads embed"]:
    """The final hidden states that predict the response tokens, at those positions only (their
    full-vocabulary logits are built later, a chunk at a time: `response_token_stats`); from packed rows
    when the batch is packed, and then only where a real response token is predicted (`packing`'s `take`,
    [slots, reads, embed]: `response_targets` are the tokens they predict, `on_response_grid` puts
    per-token results back). A batch holding the rollout's experts (`ROUTED`, router replay) routes every
    token to them (`moe.replaying`)."""
    if "packed" in batch:  # [s, P] read as [s, 1, P]: rows [s, P, embed]
        pk = batch["packed"]
        with replaying(_replayed(pk.get("experts"))):  # packed rows' experts, packed as their tokens
            h, _ = model.hidden(pk["tokens"], pk["positions"], pk["segments"] > 0, segment_ids=pk["segments"],
                                read_at=pk["take"][:, None])
        return h
    with replaying(_replayed(batch.get(ROUTED))):
        h, _ = model.hidden(batch["tokens"], batch["positions"], batch["mask"], logits_from=prompt_len - 1)
    return h[:, :-1]


def response_token_stats(
    model: nnx.Module, hidden: Float[Array, "rows reads embed"], batch: dict[str, Any], sampling: SamplingParams,
    logit_chunk: int | None, with_entropy: bool = True,
) -> tuple[Float[Array, "batch new"], Float[Array, "batch new"] | None]:
    """Log-probs of the response tokens (and the entropies) on the [batch, new] response grid, from
    `response_hidden`'s states through the model's head, `logit_chunk` positions a device at a time
    (`algorithm.logit_chunk_tokens`, `logit_chunks`). Cells that hold no response token: 0 (packed) or
    whatever the padding predicts (padded rows: the caller masks)."""
    targets = response_targets(batch)
    logp, ent = chunked_token_stats(model.head, hidden, targets.reshape(hidden.shape[:2]), sampling, logit_chunk,
                                    with_entropy)

    def grid(x):
        return None if x is None else on_response_grid(batch, x.reshape(targets.shape))

    return grid(logp), grid(ent)


def _replayed(experts: jax.Array | None) -> jax.Array | None:
    """Recorded experts [rows, length, layers, k] as `moe.replaying` takes them ([layers, rows, length, k])."""
    if experts is None:
        return None
    if pipeline.is_pipelined():  # a pipeline splits the batch inside the forward
        raise AlgorithmConfigError(
            "algorithm.router_replay=true replays each row's experts in one forward, but this call's placement is "
            "pipelined (stage > 1): give the actor's train and inference calls a layout with stage=1 (or set "
            "algorithm.router_replay=false)")
    return jnp.moveaxis(experts, 2, 0)


def response_targets(batch: dict[str, Any]) -> Int[Array, "..."]:
    """The tokens `response_hidden`'s states predict: the response grid, or a packed batch's taken ones."""
    if "packed" not in batch:
        return batch["response_tokens"]
    return jnp.take(batch["response_tokens"].reshape(-1), batch["packed"]["take_from"], mode="fill", fill_value=0)


def on_response_grid(batch: dict[str, Any], values: Float[Array, "..."]) -> Float[Array, "batch new"]:
    """Per-token `values` at `response_hidden`'s positions on the [batch, new] response grid (a packed
    batch's cells that hold no real response token: 0)."""
    if "packed" not in batch:
        return values
    rows, new = batch["response_tokens"].shape
    flat = jnp.zeros(rows * new, values.dtype).at[batch["packed"]["take_from"]].set(values, mode="drop")
    return flat.reshape(rows, new)




# ---------------------------------------------------------------- inference calls


def policy_logprobs(
    graphdef: nnx.GraphDef, sampling: SamplingParams, micro_batch: int | None, params: nnx.State,
    inputs: dict[str, Any], *, output: str = "ref_logp", replay: bool = False, logit_chunk: int | None = None,
) -> dict[str, Float[Array, "batch new"]]:
    """Log-probs of the response under a policy, same logits processing as sampling, named `output`: the
    reference model's (`ref_logp`), or the actor's before its update (`old_logp`, a rollout correction's).
    `replay` (the actor's, under router replay): its forward routes the tokens to the rollout's experts; the
    reference routes its own way even where a shared packing carries them. `logit_chunk`: positions a device
    whose logits are built at once (`algorithm.logit_chunk_tokens`)."""
    model = nnx.merge(graphdef, params)
    if not replay:
        inputs = {k: v for k, v in inputs.items() if k != ROUTED}
        if "packed_inference" in inputs:
            inputs["packed_inference"] = {k: v for k, v in inputs["packed_inference"].items() if k != "experts"}
    packed = inputs.get("packed_inference")
    p = 0 if packed is not None else inputs["tokens"].shape[1] - inputs["response_tokens"].shape[1]

    def one(b):
        logp, _ = response_token_stats(model, response_hidden(model, b, p), b, sampling, logit_chunk,
                                       with_entropy=False)
        return {output: jnp.where(b["response_mask"], logp, 0.0)}

    if packed is not None:
        return map_packed(one, {k: inputs[k] for k in RESPONSE}, packed)
    return map_microbatches(one, inputs, micro_batch)


def critic_values(
    graphdef: nnx.GraphDef, micro_batch: int | None, params: nnx.State, inputs: dict[str, Any]
) -> dict[str, jax.Array]:
    """V(s_t) for every response token (0 on padding). GAE does not bootstrap past the last token (see
    `advantages.gae`), so the output there is not read."""
    model = nnx.merge(graphdef, params)
    packed = inputs.get("packed_inference")

    def one(b):
        response_mask = b["response_mask"]
        if packed is not None:
            return {"values": jnp.where(response_mask, packed_output(model, b), 0.0)}
        tokens = b["tokens"]
        v = model(tokens, b["positions"], b["mask"])
        p = tokens.shape[1] - response_mask.shape[1]
        return {"values": jnp.where(response_mask, _response_slice(v, p), 0.0)}

    if packed is not None:
        return map_packed(one, {"response_mask": inputs["response_mask"]}, packed)
    return map_microbatches(one, inputs, micro_batch)


def reward_scores(
    graphdef: nnx.GraphDef, prefixes: tuple[str, ...], micro_batch: int | None, params: nnx.State,
    inputs: dict[str, Any],
) -> dict[str, Float[Array, " batch"]]:
    """Reward-model score of each sequence (read at its last real token), for every prefix's sequences."""
    model = nnx.merge(graphdef, params)
    packed = inputs.get("packed_inference")
    if packed is not None:  # one batch (no greedy baseline's): read at each sequence's last token
        rows = {"ended_with_eos": inputs["ended_with_eos"]}
        return map_packed(lambda b: {"model_scores": packed_output(model, b, "last")}, rows, packed)

    def one(b):
        return {f"{p}model_scores": model(b[f"{p}tokens"], b[f"{p}positions"], b[f"{p}mask"]) for p in prefixes}

    return map_microbatches(one, inputs, micro_batch)
