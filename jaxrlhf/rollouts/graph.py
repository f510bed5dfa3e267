"""The `graph` rollout: the generate call runs inside the step graph, on the static or continuous engine.

The step's feed is its batch as drawn; the executor runs the generate call where the plan places it, with
`generate_call` bound to the run's sampling settings (`generate_function`). On an off-policy plan (a shadow
generator on its own devices) the feeds of the steps up to `step + staleness` not yet started go with each
step (`RolloutStep.ahead`), so their rollouts are generated while this step trains; the rollout of step `s`
then comes from the policy of update `s - 1 - k` for some k <= staleness, which the step reports
(`rollout/staleness`, `rollout/policy_version`). A resumed run starts again from its own step: rollouts in
flight at the checkpoint are generated again, from the same batches with the same keys, never trained twice.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any

import jax
from flax import nnx

from jaxrlhf.models.engines import GENERATION_ENGINES
from jaxrlhf.models.sampling import SamplingParams
from jaxrlhf.rollouts import ROUTED, Rollout, RolloutStep


def generate_call(
    graphdef: nnx.GraphDef,
    sampling: SamplingParams,
    max_new_tokens: int,
    eos_id: int | tuple[int, ...] | None,
    pad_id: int,
    engine: tuple[str, int, int | None, int | None],
    prefix: str,
    params: nnx.State,
    inputs: dict[str, Any],
    *,
    record_experts: bool = False,
) -> dict[str, jax.Array]:
    """Sample responses to the prompts (KV cache, on-device decode loop); outputs named with `prefix`;
    with `record_experts` (router replay) also every token's experts (`ROUTED`).
    A response ends on any of the ids in `eos_id`. `engine` = (name, group_size, slots, kv_pages): the prompts
    come in groups of `group_size` adjacent copies (`repeat_rows`), which the continuous engine prefills once.
    `inputs["max_lengths"]` (optional): each response's own cap (`generation.simulated_lengths`)."""
    name, group_size, slots, kv_pages = engine
    out = GENERATION_ENGINES[name](
        graphdef, params, inputs["prompt_tokens"], inputs["prompt_mask"], inputs["rng_generate"],
        max_new_tokens=max_new_tokens, sampling=sampling, eos_id=eos_id, pad_id=pad_id,
        group_size=group_size, slots=slots, kv_pages=kv_pages, max_lengths=inputs.get("max_lengths"),
        **({"record_experts": True} if record_experts else {}),
    )
    values = {
        "tokens": out.tokens, "mask": out.mask, "positions": out.positions, "response_tokens": out.response_tokens,
        "response_mask": out.response_mask, "behaviour_logp": out.logprobs, "ended_with_eos": out.ended_with_eos,
    }
    if record_experts:
        values[ROUTED] = out.experts
    return {prefix + k: v for k, v in values.items()}


def bound_generate(algorithm: Any, *, greedy: bool = False, group_size: int | None = None, prefix: str = "",
                   stop_at_eos: bool | None = None) -> functools.partial:
    """`generate_call` bound to the run's settings (`algorithm.settings()`): its sampling (greedy when asked),
    engine and EOS ids (`stop_at_eos`; None: unless `generation.ignore_eos`), groups of `group_size` (default
    the algorithm's) and the output `prefix`."""
    s = algorithm.settings()
    tok = algorithm.tokenizer
    sampling = dataclasses.replace(s.sampling, greedy=True) if greedy else s.sampling
    stops = not s.ignore_eos if stop_at_eos is None else stop_at_eos
    eos_ids = tok.eos_ids if stops else ()
    group = algorithm.group_size if group_size is None else group_size
    return functools.partial(generate_call, algorithm.models["actor"].graphdef, sampling, s.max_new_tokens,
                             eos_ids, tok.pad_id, (s.engine, group, s.slots, s.kv_pages), prefix)


class GraphRollout(Rollout):
    """The step's feed as drawn; the generate call is the step graph's own (see the module docstring)."""

    name = "graph"

    def begin(self, executor, *, draw, start, stop, staleness=0):
        super().begin(executor, draw=draw, start=start, stop=stop, staleness=staleness)
        self.stop = stop
        self.inflight: collections.deque[dict[str, Any]] = collections.deque()  # started ahead, oldest first
        self.drawn = start  # the last step whose batch was drawn

    def step(self, step: int) -> RolloutStep:
        if self.inflight:
            this = self.inflight.popleft()
        else:
            self.drawn, this = step, self.draw(step)
            this["version"] = step - 1  # generated now, by the policy the trainer holds
        ahead = []
        while self.staleness and self.drawn < min(step + self.staleness, self.stop):
            self.drawn += 1
            later = self.draw(self.drawn)
            later["version"] = step - 1  # the shadow syncs after this step's training
            self.inflight.append(later)
            ahead.append(later["feed"])
        metrics = {}
        if self.staleness:
            metrics = {"rollout/policy_version": float(this["version"]),
                       "rollout/staleness": float(step - 1 - this["version"])}
        return RolloutStep(this["feed"], this["data_state"], tuple(ahead), metrics)

    def generate_function(self) -> functools.partial:
        s = self.algorithm.settings()
        return functools.partial(bound_generate(self.algorithm, prefix=self.algorithm.generated_prefix),
                                 record_experts=s.router_replay)
