"""What an algorithm's declaration must know about each advantage estimator, without JAX.

Whether it needs a critic decides the roles, whether whitening applies decides which keys
mean something, and `params` names the hyper-parameters it takes. The estimators themselves
(`jaxrlhf.algorithms.advantages`) are registered under these names and take these facts.

Whitening (normalising advantages over all response tokens of the global batch):
- "optional": the caller may whiten (GAE; on by default, as ReaLHF, TRL, verl and OpenRLHF do for PPO);
- "never":    the estimator normalises itself, and whitening would undo it (GRPO's group
  normalisation: an all-equal group must keep advantage 0 and advantages must not depend on
  response length), or it is not part of the method (RLOO, ReMax);
- "always":   the estimator *is* a batch normalisation (REINFORCE++), done inside.
"""

from __future__ import annotations

import dataclasses

from jaxrlhf.registry import Registry

WHITENING = ("optional", "never", "always")


@dataclasses.dataclass(frozen=True)
class EstimatorFacts:
    needs_critic: bool = False
    whitening: str = "never"
    params: tuple[str, ...] = ()  # hyper-parameters taken from those every caller offers

    def __post_init__(self) -> None:
        if self.whitening not in WHITENING:
            raise ValueError(f"whitening must be one of {WHITENING}, got {self.whitening!r}")


ESTIMATORS: Registry[EstimatorFacts] = Registry("advantage estimator", entries={
    "gae": EstimatorFacts(needs_critic=True, whitening="optional", params=("gamma", "lam")),
    "grpo": EstimatorFacts(params=("group_size", "scale_by_std")),
    "rloo": EstimatorFacts(params=("group_size",)),
    "remax": EstimatorFacts(params=("gamma",)),
    "reinforce_pp": EstimatorFacts(whitening="always", params=("gamma",)),
})
