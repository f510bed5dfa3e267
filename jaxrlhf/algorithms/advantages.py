"""Advantage estimators, selected by name from a registry.

Every estimator has the same signature

    fn(batch: AdvantageBatch, **hparams) -> (advantages [B, T], returns [B, T])

and is registered with `@register_advantage("name")`. What a caller must know about
it before JAX is loaded (whether it needs a critic, whether whitening applies, which of
the hyper-parameters every caller offers - gamma, lam, group_size, scale_by_std - it
takes) is declared under the same name in `jaxrlhf.algorithms.estimators`, so one call
site serves them all. Hyper-parameters are plain Python values (`group_size` decides
shapes, so it must be static under jit).

- "gae"          PPO with a critic: generalised advantage estimation over tokens.
- "grpo"         (r - mean_group) / (std_group + eps) over G samples per prompt
                 (`scale_by_std=False`: mean baseline only, Dr. GRPO).
- "rloo"         r minus the mean reward of the other G - 1 samples.
- "reinforce_pp" REINFORCE++: discounted return of the token rewards (KL penalty
                 included), normalised over the whole batch.
- "remax"        return-to-go minus the reward of the greedy response to the same prompt.

The outcome estimators (grpo, rloo) work on the sequence reward
`sum_t rewards[b, t]` (the shaped score, plus the KL penalty if the caller
put one into the token rewards), broadcast it to every response token, and
return `returns == advantages` (there is no value target).

Masks start at the first response token (right padding). A multi-turn trajectory's mask has gaps, its
observation tokens (`action_mask`, docs/agentic.md): the recursions of gae and the returns-to-go step over
them (an observation is part of the environment's transition, not a step of the policy), so its tokens
get nothing and the turns before it see the rewards and values after it. Advantages and returns are 0
outside the mask.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Protocol

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Float

from jaxrlhf.algorithms.estimators import ESTIMATORS
from jaxrlhf.algorithms.stats import masked_sum, masked_whiten
from jaxrlhf.registry import Registry

TokenArray = Float[Array, "batch time"]


@struct.dataclass
class AdvantageBatch:
    """Inputs of every advantage estimator (a pytree, so it passes through jit).

    rewards:          token-level rewards, e.g. `kl.token_level_rewards(...)`.
    mask:             1 on response tokens.
    values:           critic value V(s_t) of the state *before* response token t
                      (in reward units, i.e. denormalised). Needed by "gae".
    baseline_rewards: per-sequence reward of the greedy response to the same
                      prompt. Needed by "remax".
    """

    rewards: TokenArray
    mask: TokenArray | Bool[Array, "batch time"]
    values: TokenArray | None = None
    baseline_rewards: Float[Array, " batch"] | None = None


class AdvantageFn(Protocol):
    def __call__(self, batch: AdvantageBatch, **hparams) -> tuple[TokenArray, TokenArray]: ...


@dataclasses.dataclass(frozen=True)
class Estimator:
    """A registered estimator with what callers must know about it (its `EstimatorFacts`)."""

    fn: AdvantageFn
    needs_critic: bool
    whitening: str
    params: tuple[str, ...]

    def __call__(self, batch: AdvantageBatch, **hparams) -> tuple[TokenArray, TokenArray]:
        """Run with the hyper-parameters this estimator takes (others are ignored)."""
        return self.fn(batch, **{k: v for k, v in hparams.items() if k in self.params})


ADVANTAGE_ESTIMATORS: Registry[Estimator] = Registry("advantage estimator")


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator adding the estimator declared as `name` in `jaxrlhf.algorithms.estimators`."""
    facts = ESTIMATORS.get(name)

    def wrap(fn: AdvantageFn) -> AdvantageFn:
        ADVANTAGE_ESTIMATORS.register(name)(Estimator(fn, **dataclasses.asdict(facts)))
        return fn

    return wrap


def get_advantage(name: str) -> Estimator:
    """The estimator registered as `name`; a clear error naming the known ones otherwise."""
    return ADVANTAGE_ESTIMATORS.get(name)


def compute_advantages(name: str, batch: AdvantageBatch, **hparams) -> tuple[TokenArray, TokenArray]:
    """Look up `name` and run it: (advantages, returns), both [B, T]."""
    return get_advantage(name)(batch, **hparams)


def _float_mask(batch: AdvantageBatch) -> TokenArray:
    return jnp.asarray(batch.mask).astype(jnp.float32)


def _next_in_mask(x: TokenArray, mask: TokenArray) -> TokenArray:
    """For every position, `x` at the next position inside `mask` (0 when none follows): the plain shift by
    one for a mask without gaps, the first model token after an observation for a multi-turn mask."""

    def step(following: Float[Array, " batch"], xs):
        x_t, m_t = xs
        return jnp.where(m_t > 0, x_t, following), following

    _, out = jax.lax.scan(step, jnp.zeros(x.shape[0], x.dtype), ((x * mask).T, mask.T), reverse=True)
    return out.T


@register_advantage("gae")
def gae(batch: AdvantageBatch, *, gamma: float = 1.0, lam: float = 1.0) -> tuple[TokenArray, TokenArray]:
    """Generalised advantage estimation (Schulman et al. 2016) over response tokens.

    delta_t = r_t + gamma * V_{t+1} - V_t,  A_t = delta_t + gamma * lam * A_{t+1},
    returns_t = A_t + V_t. After the last response token V is 0, also for a
    response cut at the length limit: the critic's output after the cut is never
    a value target (no reward follows it to learn from), so bootstrapping from
    it would add an untrained number to every advantage of the row. TRL and verl
    end every response the same way (docs/algorithms.md). The recursion runs
    backwards with `lax.scan`, so it compiles to one loop for any T.
    """
    if batch.values is None:
        raise ValueError("advantage estimator 'gae' needs batch.values from the critic")
    mask = _float_mask(batch)
    rewards = batch.rewards.astype(jnp.float32) * mask
    values = batch.values.astype(jnp.float32) * mask

    # V of the next state for every token: the next token's value inside the mask (0 after the last token).
    # A multi-turn mask has gaps (observation tokens): the recursion steps over them, so a turn's next state
    # is the first model token after the observation; for a mask without gaps this is the plain shift.
    next_values = _next_in_mask(values, mask)
    deltas = (rewards + gamma * next_values - values) * mask

    def step(next_adv: Float[Array, "batch"], xs):
        delta_t, mask_t = xs
        adv_t = (delta_t + gamma * lam * next_adv) * mask_t
        return jnp.where(mask_t > 0, adv_t, next_adv), adv_t  # carried across a gap, unchanged

    _, adv_time_major = jax.lax.scan(
        step, jnp.zeros(mask.shape[0], jnp.float32), (deltas.T, mask.T), reverse=True
    )
    advantages = adv_time_major.T
    returns = (advantages + values) * mask
    return advantages, returns


def _sequence_rewards(batch: AdvantageBatch) -> Float[Array, " batch"]:
    return masked_sum(batch.rewards.astype(jnp.float32), _float_mask(batch), axis=-1)


def _grouped(x: Float[Array, " batch"], group_size: int) -> Float[Array, "prompts group"]:
    if group_size < 1 or x.shape[0] % group_size:
        raise ValueError(
            f"batch of {x.shape[0]} sequences is not a whole number of groups of group_size={group_size}; "
            "the G samples of a prompt must be adjacent"
        )
    return x.reshape(-1, group_size)


def _broadcast(seq_adv: Float[Array, " batch"], batch: AdvantageBatch) -> tuple[TokenArray, TokenArray]:
    adv = seq_adv[:, None] * _float_mask(batch)
    return adv, adv


@register_advantage("grpo")
def grpo(
    batch: AdvantageBatch, *, group_size: int, eps: float = 1e-6, scale_by_std: bool = True
) -> tuple[TokenArray, TokenArray]:
    """Group-normalised outcome advantage (Shao et al. 2024, GRPO).

    The G = `group_size` samples of one prompt must be adjacent in the batch.
    A = (r - mean_group) / (std_group + eps), with the unbiased (G - 1) std as
    TRL/verl. `scale_by_std=False` keeps only the mean baseline (Dr. GRPO).
    Groups with identical rewards get exactly 0.
    """
    r = _grouped(_sequence_rewards(batch), group_size)
    adv = r - jnp.sum(r, axis=1, keepdims=True) / group_size
    if scale_by_std:
        std = jnp.std(r, axis=1, keepdims=True, ddof=1) if group_size > 1 else jnp.zeros_like(r)
        adv = adv / (std + eps)
    # A group whose rewards are all equal (all right / all wrong) carries no
    # signal. Make its advantage exactly 0: float32 rounding in the mean
    # (~1e-7) divided by std + eps (~1e-6) would otherwise give |A| ~ 0.1.
    constant = jnp.all(r == r[:, :1], axis=1, keepdims=True)
    adv = jnp.where(constant, 0.0, adv)
    return _broadcast(adv.reshape(-1), batch)


@register_advantage("rloo")
def rloo(batch: AdvantageBatch, *, group_size: int) -> tuple[TokenArray, TokenArray]:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024).

    Each sample's baseline is the mean reward of the other G - 1 samples of
    its prompt, so the baseline does not depend on the sample itself (unbiased).
    """
    if group_size < 2:
        raise ValueError(f"'rloo' needs group_size >= 2 samples per prompt, got {group_size}")
    r = _grouped(_sequence_rewards(batch), group_size)
    baseline = (jnp.sum(r, axis=1, keepdims=True) - r) / (group_size - 1)
    return _broadcast((r - baseline).reshape(-1), batch)


@register_advantage("remax")
def remax(batch: AdvantageBatch, *, gamma: float = 1.0) -> tuple[TokenArray, TokenArray]:
    """ReMax (Li et al. 2023): the greedy response's reward is the baseline.

    A_t = sum_{k >= t} gamma^(k - t) r_k - baseline, with `batch.baseline_rewards[b]`
    the shaped score of the greedy decode of sequence b's prompt (no KL in it), as
    verl; without a KL penalty in the token rewards that is simply r - r_greedy.
    It lowers variance without a critic; nothing is whitened.
    """
    if batch.baseline_rewards is None:
        raise ValueError("advantage estimator 'remax' needs batch.baseline_rewards (greedy-sample rewards)")
    mask = _float_mask(batch)
    returns = _returns_to_go(batch.rewards.astype(jnp.float32) * mask, mask, gamma)
    adv = (returns - batch.baseline_rewards.astype(jnp.float32)[:, None]) * mask
    return adv, adv


def _returns_to_go(rewards: TokenArray, mask: TokenArray, gamma: float) -> TokenArray:
    """G_t = sum_{k >= t} gamma^(k - t) r_k inside the mask (a reverse scan: one loop for any T)."""

    def step(next_return: Float[Array, " batch"], xs):
        r_t, m_t = xs
        g_t = (r_t + gamma * next_return) * m_t
        return jnp.where(m_t > 0, g_t, next_return), g_t  # carried across a gap in the mask (observations)

    _, returns_tm = jax.lax.scan(step, jnp.zeros(mask.shape[0], jnp.float32), (rewards.T, mask.T), reverse=True)
    return returns_tm.T


@register_advantage("reinforce_pp")
def reinforce_pp(batch: AdvantageBatch, *, gamma: float = 1.0) -> tuple[TokenArray, TokenArray]:
    """REINFORCE++ (Hu 2025): token-level returns, normalised over the whole batch.

    G_t = sum_{k >= t} gamma^(k - t) r_k over the token rewards (score on the last
    token, -coef * KL on every token), then (G - mean) / std over every response
    token of the global batch (under jit on a sharded batch these are global
    statistics). No critic and no per-prompt baseline: the batch statistics are
    the baseline. `returns` are the undiscounted-by-normalisation G.
    """
    mask = _float_mask(batch)
    returns = _returns_to_go(batch.rewards.astype(jnp.float32) * mask, mask, gamma)
    return masked_whiten(returns, mask), returns
