"""The host steps of RL from rollouts and the host side of a step's feed: prompts repeated into groups,
each response's drawn length, the batch cut to its longest response, and DAPO's dynamic sampling, the one
filter both the step's `select_groups` host step and the partial-rollout stream (`rollouts.stream`) use.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jaxrlhf.algorithms.rewards import shape_scores
from jaxrlhf.models.lengths import lognormal_lengths, response_width
from jaxrlhf.rollouts import ROUTED, SEQUENCE


def repeat_rows(batch: Any, g: int) -> Any:
    """Every prompt of a batch repeated `g` times, adjacent (GRPO-style groups of samples)."""
    if g == 1:
        return batch
    rep = lambda xs: tuple(x for x in xs for _ in range(g))  # noqa: E731
    return dataclasses.replace(
        batch,
        input_ids=np.repeat(batch.input_ids, g, axis=0),
        attention_mask=np.repeat(batch.attention_mask, g, axis=0),
        prompt_lens=np.repeat(batch.prompt_lens, g, axis=0),
        prompts=rep(batch.prompts),
        answers=rep(batch.answers),
        meta=rep(batch.meta),
        row_ids=np.repeat(batch.row_ids, g, axis=0),
        global_batch_size=batch.global_batch_size * g,
    )


def trim_responses(batch: dict[str, Any], max_new_tokens: int) -> dict[str, np.ndarray]:
    """The rollout batch (`GENERATED` values, on host) cut to its longest response, rounded up to one of
    `lengths.response_widths`: the columns past it are padding in every row (response mask False), so the
    train and inference calls would compute them only to mask them out. The math is unchanged: attention
    is causal, and every loss, advantage and KL is masked by `response_mask` (length normalisations use
    `max_new_tokens`, not the width)."""
    response_mask = np.asarray(batch["response_mask"])
    n = response_mask.shape[1]
    prompt = np.asarray(batch["tokens"]).shape[1] - n
    width = response_width(int(response_mask.sum(axis=1).max(initial=0)), max_new_tokens)
    out = {}
    for name, x in batch.items():
        x = np.asarray(x)
        if name in SEQUENCE or name == ROUTED:
            x = x[:, :prompt + width]
        elif x.ndim == 2:
            x = x[:, :width]
        out[name] = x
    return out


def informative_groups(scores: np.ndarray, group_size: int) -> np.ndarray:
    """Per group of `group_size` adjacent rows: whether its scores differ. A group whose scores are all equal has
    advantage 0 under any group baseline: it carries no gradient but still dilutes a token mean."""
    per_group = np.asarray(scores, np.float32).reshape(-1, group_size)
    return ~np.all(per_group == per_group[:, :1], axis=1)


def select_groups(
    pool: dict[str, Any], scores: np.ndarray, group_size: int, groups: int
) -> tuple[dict[str, Any], dict[str, float]]:
    """DAPO's dynamic sampling: `groups` groups of `group_size` adjacent rows from a larger pool.

    Informative groups (`informative_groups`) are taken first, in pool order; when the pool holds fewer than
    `groups`, the batch is filled with uninformative ones whose `response_mask` is cleared, so they count as
    no tokens at all (the loss sees only the informative groups, as after verl's filter). `pool` maps names to
    arrays (or dicts of arrays) with the pool's rows first; returns the selected rows and counts for logging.
    """
    informative = informative_groups(scores, group_size)
    if len(informative) < groups:
        raise ValueError(f"a pool of {len(informative)} groups cannot fill {groups}")
    order = np.concatenate([np.flatnonzero(informative), np.flatnonzero(~informative)])[:groups]
    rows = (order[:, None] * group_size + np.arange(group_size)).reshape(-1)
    out = jax.tree_util.tree_map(lambda x: np.asarray(x)[rows], pool)
    keep = np.repeat(informative[order], group_size)
    out["response_mask"] = np.asarray(out["response_mask"]) & keep[:, None]
    stats = {"dynamic_sampling/pool_groups": float(len(informative)),
             "dynamic_sampling/informative_groups": float(informative.sum()),
             "dynamic_sampling/kept_groups": float(keep.sum() // group_size)}
    return out, stats


@dataclasses.dataclass(frozen=True)
class GroupFilter:
    """DAPO's dynamic sampling as a run configures it: which groups are informative, told apart by the task
    score the advantage sees (rule scores through the EOS gate, bias, scale and clip), without the overlong
    penalty (DAPO filters on accuracy, and the length ramp alone is no signal); a batch keeps `groups` of them.
    The synchronous step's `select_groups` host step and the partial-rollout stream both filter through it."""

    group_size: int
    groups: int  # groups a batch keeps: data.batch_size
    bias: float = 0.0
    scale: float = 1.0
    clip: float | None = None
    eos_only: bool = True

    def scores(self, rule_scores: np.ndarray, ended_with_eos: np.ndarray) -> np.ndarray:
        """The scores groups are told apart by."""
        return np.asarray(shape_scores(np.asarray(rule_scores, np.float32), np.asarray(ended_with_eos),
                                       bias=self.bias, scale=self.scale, clip=self.clip, eos_only=self.eos_only))

    def informative(self, rule_scores: np.ndarray, ended_with_eos: np.ndarray) -> np.ndarray:
        """Per group: whether its scores differ."""
        return informative_groups(self.scores(rule_scores, ended_with_eos), self.group_size)

    def select(self, pool: dict[str, Any], rule_scores: np.ndarray) -> tuple[dict[str, Any], dict[str, float]]:
        """The batch's `groups` groups from `pool` (which holds `ended_with_eos`), informative ones first."""
        return select_groups(pool, self.scores(rule_scores, pool["ended_with_eos"]), self.group_size, self.groups)


def simulated_lengths(cfg: Any, rng: jax.Array, rows: int) -> np.ndarray:
    """Each response's length under `generation.simulated_lengths`: log-normal around
    `plan.response_length_median` with `plan.response_length_sigma`, capped at `generation.max_new_tokens`
    (`lengths.lognormal_lengths`, the planner's distribution), drawn from the step's generation key."""
    seed = np.asarray(jax.random.key_data(rng)).astype(np.uint32).ravel()
    z = np.random.default_rng(seed).standard_normal(rows)
    return lognormal_lengths(z, cfg.plan.response_length_median, cfg.plan.response_length_sigma,
                             cfg.generation.max_new_tokens).astype(np.int32)
