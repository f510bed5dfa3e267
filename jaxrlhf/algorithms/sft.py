"""SFT: supervised fine-tuning on demonstrations, the loss on response tokens only.

One step is one optimizer update on a batch of (prompt, completion + EOS)
sequences: next-token negative log-likelihood averaged over every completion
token of the global batch (prompt tokens are context, never targets; TRL's
completion-only loss). With `data.packing` several demonstrations share a
row, separated by segment ids: attention stays inside each demonstration and
its positions restart at 0, so packing changes the compute, not the loss
(the first token of a demonstration is a prompt token, never a target).

The same stage is the actor's warm-up before RL (`sft.steps > 0`): then it
reads the `sft` section (source, split, batch size, learning rate, packing)
and runs on the actor's training placement of the RL plan.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxrlhf.algorithms.stats import masked_mean
from jaxrlhf.algorithms.update import loss_aux, map_microbatches, minibatch_updates
from jaxrlhf.models.sampling import next_token_logprobs


def sft_nll(
    graphdef: nnx.GraphDef, params: nnx.State, inputs: dict[str, Any]
) -> tuple[jax.Array, jax.Array]:
    """(token-mean NLL of the completion tokens, number of those tokens) of one batch."""
    model = nnx.merge(graphdef, params)
    logits, _ = model(inputs["tokens"], inputs["positions"], inputs["mask"], segment_ids=inputs.get("segment_ids"))
    nll = -next_token_logprobs(logits, inputs["tokens"])
    targets = inputs["loss_mask"][:, 1:]
    return masked_mean(nll, targets), jnp.sum(targets.astype(jnp.float32))


def sft_train(
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    micro_batch: int | None,
    params: nnx.State,
    opt_state: Any,
    inputs: dict[str, Any],
) -> tuple[nnx.State, Any, dict[str, Any]]:
    """One supervised update (skipped if the loss or gradients are non-finite)."""
    data = {k: v for k, v in inputs.items() if k != "rng_actor"}

    def loss_fn(params, mb):
        loss, tokens = sft_nll(graphdef, params, mb)
        return loss, loss_aux({"loss/sft": loss, "sft/target_tokens": tokens}, tokens)

    params, opt_state, stats = minibatch_updates(loss_fn, optimizer, params, opt_state, data, inputs["rng_actor"],
                                                 micro_batch=micro_batch)
    return params, opt_state, {"actor_stats": stats}


def sft_eval(
    graphdef: nnx.GraphDef, micro_batch: int | None, params: nnx.State, inputs: dict[str, Any]
) -> dict[str, jax.Array]:
    """Summed NLL and target count of a held-out batch, per row (rows weighted on the host)."""
    model = nnx.merge(graphdef, params)

    def one(b):
        logits, _ = model(b["tokens"], b["positions"], b["mask"], segment_ids=b.get("segment_ids"))
        targets = b["loss_mask"][:, 1:].astype(jnp.float32)
        nll = -next_token_logprobs(logits, b["tokens"]) * targets
        return {"nll": jnp.sum(nll, axis=1), "targets": jnp.sum(targets, axis=1)}

    return map_microbatches(one, inputs, micro_batch)


class SFTRuntime:
    """The runtime half of the `sft` stage (declared in jaxrlhf.algorithms.stages)."""

    def functions(self) -> dict[str, Any]:
        actor = self.models["actor"]
        return {"actor.train": functools.partial(sft_train, actor.graphdef, actor.optimizer,
                                                 self.execution.micro_batch("actor.train"))}

    def dataset(self, tokenizer: Any, split: str | None = None) -> Any:
        from jaxrlhf.data import SFTDataset
        from jaxrlhf.environments import TOOLS

        names = self.cfg.sft.tools if self.warmup else None  # demonstrations of an environment's episodes
        tools = None if names is None else [TOOLS.get(name) for name in names]
        return SFTDataset.from_config(self.cfg, tokenizer, warmup=self.warmup, split=split, tools=tools)

    @staticmethod
    def _arrays(batch: Any) -> dict[str, Any]:
        out = {"tokens": batch.input_ids, "mask": batch.attention_mask, "loss_mask": batch.loss_mask,
               "positions": batch.positions}
        if batch.segment_ids is not None:
            out["segment_ids"] = batch.segment_ids
        return out

    def feed(self, batch: Any, rng: jax.Array) -> dict[str, Any]:
        return {**self._arrays(batch), "rng_actor": rng}

    def metric_values(self) -> tuple[str, ...]:
        return ("actor_stats",)

    def metrics(self, result: Any) -> dict[str, float]:
        stats, mask = jax.device_get((result.values["actor_stats"], result.values["mask"]))
        out = {k: float(v) for k, v in stats.items()}
        out["throughput/tokens_per_s"] = float(np.sum(mask)) / max(result.seconds, 1e-9)
        return out

    def evaluate(self, executor: Any) -> dict[str, float]:
        """Token-mean NLL of the completions of the held-out split."""
        if not self.cfg.data.eval_split:
            return {}
        nll = count = 0.0
        for batch, weight in self.dataset(self.tokenizer, split=self.cfg.data.eval_split).single_pass():
            out = jax.device_get(executor.run_at("actor.train", self._eval_fn, self._arrays(batch)))
            nll += float(np.sum(out["nll"] * weight))
            count += float(np.sum(out["targets"] * weight))
        return {"eval/loss": nll / max(count, 1.0)}

    @functools.cached_property
    def _eval_fn(self) -> Any:
        return functools.partial(sft_eval, self.models["actor"].graphdef, self.cfg.algorithm.micro_batch_size)
