"""REINFORCE++ (Hu 2025, OpenRLHF): no critic, no per-prompt baseline, global batch normalisation.

Token rewards carry the KL penalty to the reference (k1 per token, as PPO);
the discounted return of every token is normalised over all response tokens
of the global batch, which serves as the baseline; the update is the clipped
PPO surrogate. Works with one sample per prompt (`algorithm.group_size=1`).
"""

from jaxrlhf.algorithms.base import register_algorithm
from jaxrlhf.algorithms.rl import RolloutAlgorithm


@register_algorithm
class ReinforcePP(RolloutAlgorithm):
    name = "reinforce_pp"
    estimator = "reinforce_pp"
    loss = "ppo"
    kl_in_reward = True
