"""DPO (Rafailov et al. 2023) and IPO (Azar et al. 2023): preference optimisation without a reward model.

x = (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l)), log-probs
summed over the response tokens. DPO: -(1 - ls) log sigmoid(beta x) - ls log
sigmoid(-beta x) (`algorithm.dpo_label_smoothing` = ls; 0 is plain DPO, > 0 the
conservative cDPO of OpenRLHF and TRL <= 0.28). IPO: (x' - 1 / (2 beta))^2 with
x' built from log-probs averaged over each response's length (TRL, as the IPO
authors confirmed; OpenRLHF sums). Implicit rewards beta (log pi - log pi_ref)
and their accuracy (chosen > rejected, strictly) are logged every step and,
with `run.eval_every`, on `data.eval_split`.

The stage is declared in `jaxrlhf.algorithms.stages`; this is its runtime. The step graph: `ref.inference` (reference log-probs of both responses, on
the reference's placement) then `actor.train`.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxrlhf.algorithms.pairs import pair_arrays, pair_logprobs
from jaxrlhf.algorithms.stages import PAIR, REF
from jaxrlhf.algorithms.update import loss_aux, map_microbatches, map_packed, minibatch_updates
from jaxrlhf.models.packing import pack_batch
from jaxrlhf.models.transformer import positions_from_mask


def dpo_loss(
    logp: jax.Array, ref_logp: jax.Array, lengths: jax.Array, *, beta: float, label_smoothing: float, kind: str,
    present: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Loss over pairs from [2, B] summed log-probs (chosen row 0, rejected row 1) and response lengths;
    `present` ([B], a packed micro-batch's pairs) leaves the other columns out of every mean."""
    ratio = logp - ref_logp
    rewards = beta * jax.lax.stop_gradient(ratio)
    if kind == "ipo":
        per_token = ratio / jnp.maximum(lengths, 1.0)
        losses = jnp.square(per_token[0] - per_token[1] - 1.0 / (2.0 * beta))
    else:
        x = beta * (ratio[0] - ratio[1])
        losses = -(1.0 - label_smoothing) * jax.nn.log_sigmoid(x) - label_smoothing * jax.nn.log_sigmoid(-x)
    w = jnp.ones(losses.shape, jnp.float32) if present is None else present.astype(jnp.float32)
    mean = lambda x: jnp.sum(x * w) / jnp.maximum(jnp.sum(w), 1.0)  # noqa: E731
    loss = mean(losses)
    stats = {
        "loss/dpo": loss,
        "rewards/chosen": mean(rewards[0]),
        "rewards/rejected": mean(rewards[1]),
        "rewards/margin": mean(rewards[0] - rewards[1]),
        "rewards/accuracy": mean((rewards[0] > rewards[1]).astype(jnp.float32)),
        "logps/chosen": mean(jax.lax.stop_gradient(logp[0])),
        "logps/rejected": mean(jax.lax.stop_gradient(logp[1])),
    }
    return loss, jax.lax.stop_gradient(stats)


# ---------------------------------------------------------------- packed pairs (`algorithm.pack_sequences`)
# The pair batch as sequences, interleaved (row 2i: pair i's chosen, 2i + 1: its rejected), packed by
# `models.packing.pack_batch` with every next-token position read (response width L - 1) and each pair
# kept in one micro-batch (group 2): the model reads the logits that predict every token, and each
# sequence's summed log-prob over its loss mask is the unpacked `pair_logprobs`'.


def interleaved_pairs(inputs: dict[str, Any], name: str) -> Any:
    """[B, ...] chosen and rejected arrays as one [2B, ...] array, pair i at rows 2i (chosen), 2i + 1."""
    c, r = inputs[f"chosen_{name}"], inputs[f"rejected_{name}"]
    xp = np if isinstance(c, np.ndarray) else jnp
    return xp.stack([c, r], axis=1).reshape(-1, *c.shape[1:])


def packed_sequence_data(inputs: dict[str, Any]) -> dict[str, jax.Array]:
    """Per sequence (interleaved): the tokens each read position predicts and which of them count."""
    tokens, loss_mask = interleaved_pairs(inputs, "tokens"), interleaved_pairs(inputs, "loss_mask")
    return {"targets": tokens[:, 1:], "counted": loss_mask[:, 1:].astype(jnp.float32)}


def packed_sequence_logprobs(model: nnx.Module, mb: dict[str, Any]) -> tuple[jax.Array, jax.Array]:
    """Summed log-probs of each slot's counted tokens, and their counts ([slots] each)."""
    pk = mb["packed"]
    # logits only at the real tokens' read positions (`packing`'s `take`), put back on the [slots, L - 1] grid
    logits, _ = model(pk["tokens"], pk["positions"], pk["segments"] > 0, segment_ids=pk["segments"],
                      read_at=pk["take"][:, None])
    logp = jax.nn.log_softmax(logits.reshape(-1, logits.shape[-1]).astype(jnp.float32), axis=-1)
    targets = jnp.take(mb["targets"].reshape(-1), pk["take_from"], mode="fill", fill_value=0)
    logp = jnp.take_along_axis(logp, targets[:, None].astype(jnp.int32), axis=-1)[:, 0]
    grid = jnp.zeros(mb["targets"].size, logp.dtype).at[pk["take_from"]].set(logp, mode="drop")
    return jnp.sum(grid.reshape(mb["targets"].shape) * mb["counted"], axis=1), jnp.sum(mb["counted"], axis=1)


def packed_pair_logprobs(
    graphdef: nnx.GraphDef, params: nnx.State, inputs: dict[str, Any]
) -> dict[str, jax.Array]:
    """The reference's summed log-probs of both responses of every pair, from packed rows."""
    model = nnx.merge(graphdef, params)
    out = map_packed(lambda b: {"logp": packed_sequence_logprobs(model, b)[0]}, packed_sequence_data(inputs),
                     inputs["packed_pairs"])["logp"]
    return {REF[0]: out[0::2], REF[1]: out[1::2]}


def named_pair_logprobs(
    names: tuple[str, str], graphdef: nnx.GraphDef, micro_batch: int | None, params: nnx.State,
    inputs: dict[str, Any],
) -> dict[str, jax.Array]:
    """Summed response log-probs of the chosen and rejected sequences, under `names`."""
    def one(b):
        logp, _ = pair_logprobs(graphdef, params, b)
        return dict(zip(names, (logp[0], logp[1])))

    return map_microbatches(one, inputs, micro_batch)


ref_pair_logprobs = functools.partial(named_pair_logprobs, REF)
policy_pair_logprobs = functools.partial(named_pair_logprobs, ("chosen", "rejected"))


def dpo_train(
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    beta: float,
    label_smoothing: float,
    kind: str,
    micro_batch: int | None,
    params: nnx.State,
    opt_state: Any,
    inputs: dict[str, Any],
) -> tuple[nnx.State, Any, dict[str, Any]]:
    """One DPO (or IPO) update of the actor; from packed rows when the pairs come packed."""
    packed = inputs.get("packed_pairs")
    if packed is not None:
        pairs = inputs["chosen_tokens"].shape[0]
        ref_of = interleaved_pairs({"chosen_ref": inputs[REF[0]], "rejected_ref": inputs[REF[1]]}, "ref")
        data = {**packed_sequence_data(inputs), "ref": ref_of}

        def loss_fn(params, mb):
            logp, lengths = packed_sequence_logprobs(nnx.merge(graphdef, params), mb)
            # each slot's sequence back to its pair's column ([2, pairs]; an empty slot's index is dropped)
            seq = mb["packed"]["slots"]
            pair, side = seq // 2, seq % 2
            grid = lambda x: jnp.zeros((2, pairs), x.dtype).at[side, pair].set(x, mode="drop")  # noqa: E731
            present = jnp.zeros((pairs,), bool).at[pair].set(True, mode="drop")
            loss, stats = dpo_loss(grid(logp), grid(mb["ref"]), grid(lengths), beta=beta,
                                   label_smoothing=label_smoothing, kind=kind, present=present)
            return loss, loss_aux(stats, jnp.sum(present.astype(jnp.float32)))
    else:
        data = {k: inputs[k] for k in (*PAIR, *REF)}

        def loss_fn(params, mb):
            logp, lengths = pair_logprobs(graphdef, params, mb)
            ref = jnp.stack([mb["ref_chosen_logp"], mb["ref_rejected_logp"]])
            loss, stats = dpo_loss(logp, ref, lengths, beta=beta, label_smoothing=label_smoothing, kind=kind)
            return loss, loss_aux(stats, mb["chosen_tokens"].shape[0])

    params, opt_state, stats = minibatch_updates(loss_fn, optimizer, params, opt_state, data, inputs["rng_actor"],
                                                 micro_batch=micro_batch, packed=packed)
    return params, opt_state, {"actor_stats": stats}


class DPORuntime:
    """The runtime half of the `dpo` stage (declared in jaxrlhf.algorithms.stages)."""

    def functions(self) -> dict[str, Any]:
        alg, m, micro = self.cfg.algorithm, self.models, self.execution.micro_batch
        ref = functools.partial(packed_pair_logprobs, m["ref"].graphdef) if self.packs else \
            functools.partial(ref_pair_logprobs, m["ref"].graphdef, micro("ref.inference"))
        return {
            "ref.inference": ref,
            "actor.train": functools.partial(dpo_train, m["actor"].graphdef, m["actor"].optimizer, alg.dpo_beta,
                                             alg.dpo_label_smoothing, alg.dpo_loss, micro("actor.train")),
        }

    def host_steps(self) -> dict[str, Any]:
        return {"pack_pairs": self._pack_pairs} if self.packs else {}

    def _pack_pairs(self, chosen_tokens, chosen_mask, rejected_tokens, rejected_mask, shards):
        """The host step `pack_pairs`: the pairs' sequences, interleaved, packed once for both calls (one
        update: DPO's call trains the batch in one minibatch), each pair in one micro-batch."""
        pairs = {"chosen_tokens": chosen_tokens, "chosen_mask": chosen_mask, "rejected_tokens": rejected_tokens,
                 "rejected_mask": rejected_mask}
        mask = np.asarray(interleaved_pairs(pairs, "mask"), bool)
        tokens = np.asarray(interleaved_pairs(pairs, "tokens"))
        positions = np.asarray(positions_from_mask(jnp.asarray(mask)))  # the rule every forward uses
        packed, stats = pack_batch(mask, tokens, positions, mask.shape[1] - 1, np.arange(len(mask))[None],
                                   shards=math.lcm(*shards.values()),
                                   budget=self.execution.token_budget, group=2,
                                   blockwise=self.one_row(tuple(shards)))
        return {"packed_pairs": packed, "packing_stats": {
            **{k: np.float32(v) for k, v in stats.metrics("packing/pairs").items()},
            "packing/pairs/micro_batches": np.float32(packed["slots"].shape[2])}}

    def dataset(self, tokenizer: Any, split: str | None = None) -> Any:
        from jaxrlhf.data import PreferenceDataset

        return PreferenceDataset.from_config(self.cfg, tokenizer, split=split)

    def feed(self, batch: Any, rng: jax.Array) -> dict[str, Any]:
        return {**pair_arrays(batch), "rng_actor": rng}

    def metric_values(self) -> tuple[str, ...]:
        return ("actor_stats", "packing_stats")

    def metrics(self, result: Any) -> dict[str, float]:
        v = result.values
        out = {k: float(x) for k, x in jax.device_get(v["actor_stats"]).items()}
        out.update({k: float(x) for k, x in v.get("packing_stats", {}).items()})
        tokens = float(np.sum(v["chosen_mask"]) + np.sum(v["rejected_mask"]))
        out["throughput/tokens_per_s"] = tokens / max(result.seconds, 1e-9)
        return out

    def evaluate(self, executor: Any) -> dict[str, float]:
        """Implicit-reward accuracy and margin on the held-out pairs."""
        if not self.cfg.data.eval_split:
            return {}
        beta = self.cfg.algorithm.dpo_beta
        right = margin = total = 0.0
        for batch, weight in self.dataset(self.tokenizer, split=self.cfg.data.eval_split).single_pass():
            inputs = pair_arrays(batch)
            ref = jax.device_get(executor.run_at("ref.inference", self._eval_fns[0], inputs))
            pol = jax.device_get(executor.run_at("actor.train", self._eval_fns[1], inputs))
            r_c = beta * (pol["chosen"] - ref["ref_chosen_logp"])
            r_r = beta * (pol["rejected"] - ref["ref_rejected_logp"])
            right += float(np.sum((r_c > r_r) * weight))
            margin += float(np.sum((r_c - r_r) * weight))
            total += float(np.sum(weight))
        return {"eval/rewards_accuracy": right / max(total, 1.0), "eval/rewards_margin": margin / max(total, 1.0)}

    @functools.cached_property
    def _eval_fns(self) -> tuple[Any, Any]:
        micro = self.cfg.algorithm.micro_batch_size
        return (functools.partial(ref_pair_logprobs, self.models["ref"].graphdef, micro),
                functools.partial(policy_pair_logprobs, self.models["actor"].graphdef, micro))
