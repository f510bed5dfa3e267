"""ReMax (Li et al. 2023): REINFORCE with the greedy response's reward as the baseline.

The step adds a second generate call of the actor (`actor.generate_greedy`,
greedy decoding of the same prompts); the greedy responses are scored like
the sampled ones (rule rewards and/or the reward model, shaped the same way)
and that score is subtracted from each sampled response's reward (which
includes the token-level KL penalty, as verl). No critic, no whitening.
"""

from jaxrlhf.algorithms.base import register_algorithm
from jaxrlhf.algorithms.rl import RolloutAlgorithm


@register_algorithm
class ReMax(RolloutAlgorithm):
    name = "remax"
    estimator = "remax"
    loss = "ppo"
    kl_in_reward = True
    greedy_baseline = True
