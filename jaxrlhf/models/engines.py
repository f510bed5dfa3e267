"""Generation engines by name (`generation.engine`): one signature, so a placed generate call and the
planner pick the same one from the config.

These are the two engines the step graph's generate call runs (the `graph` rollout, `jaxrlhf.rollouts`).
There are four generation paths in all; the other two drive their own programs from the host and keep
state across calls: the streaming engine of partial rollouts (`models.streaming`, the `stream` rollout)
and the multi-turn engine (`models.multiturn`: environment episodes, the `episodes` rollout, and the
agent endpoint's per-episode cache, `environments.backends.CachedBackend`).

- "static": `generation.generate_tokens`: each distinct prompt prefilled once, the whole batch decoded
  together until its longest row ends; cache batch x (prompt + max_new_tokens).
- "continuous": `continuous.generate_continuous`: each distinct prompt prefilled once, a pool of `slots`
  rows that finished rows leave and waiting rows enter, a paged cache of prompt pages + `kv_pages`
  response pages, steps as narrow as the rows still running.

Every engine is called as `generate_continuous` is: (graphdef, state, prompt_tokens, prompt_mask, rng,
*, max_new_tokens, sampling, eos_id, pad_id, group_size, slots, kv_pages, max_lengths). Both return a
`GenerationOutput` in the original row order with the processed-distribution log-probs.
"""

from __future__ import annotations

from typing import Any, Callable

from jaxrlhf.models.continuous import generate_continuous
from jaxrlhf.models.generation import GenerationOutput, generate_tokens
from jaxrlhf.registry import Registry

GENERATION_ENGINES: Registry[Callable[..., GenerationOutput]] = Registry("generation engine")


@GENERATION_ENGINES.register("static")
def static_engine(*args: Any, slots: int | None = None, kv_pages: int | None = None,
                  **kwargs: Any) -> GenerationOutput:
    """`generate_tokens` with the shared signature: `slots` and `kv_pages` do not apply to a static batch
    (every row is decoded over a dense cache; a group's prompt is prefilled once)."""
    del slots, kv_pages
    return generate_tokens(*args, **kwargs)


GENERATION_ENGINES.register("continuous")(generate_continuous)
